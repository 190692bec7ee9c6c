"""Google Cloud Storage: ``gs://bucket/prefix``.

Objects up to ``options.part_size`` go in one multipart request; larger ones in a resumable upload of
``part_size`` chunks (a reset costs one chunk, not the file), and are downloaded as parallel ranges. Uploads and downloads carry CRC32C
checks (``checksum="crc32c"``); the file's sha256 is stored as object metadata. Every call passes
the library's ``DEFAULT_RETRY`` (exponential backoff on 429/5xx/resets, ``options.deadline`` in all) and
``timeout=(connect_timeout, read_timeout)``, uploads included: our keys
are content-addressed or small pointers, so repeating a put is harmless.

Credentials come from Application Default Credentials. An emulator (fake-gcs-server) is used when
``options.endpoint_url`` or ``STORAGE_EMULATOR_HOST`` is set, with anonymous credentials.

``google.api_core`` exceptions are translated in :func:`_translate`: ``NotFound`` -> ``NotFound``,
``Forbidden``/``Unauthorized``/``DefaultCredentialsError`` -> ``CredentialsError``, 5xx/429/
connection errors -> ``TransientError``, a checksum mismatch -> ``IntegrityError``.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from spotguard.storage._bounded import BoundedWriter
from spotguard.storage._verify import VerifyingReader
from spotguard.storage.base import (
    MAX_SMALL_BYTES,
    CredentialsError,
    IntegrityError,
    Interrupted,
    NotFound,
    StoreError,
    StoreOptions,
    TransientError,
    cause_of,
    check_range,
    check_size,
    cut_headers_are_errors,
    join_key,
    transport_error,
)

__all__ = ["GcsStore"]


@contextlib.contextmanager
def _translate(what: str):
    import google.api_core.exceptions as gex
    import google.auth.exceptions as aex
    import requests

    try:
        yield
    except Interrupted:  # the caller's own abandonment: not a store failure
        raise
    except gex.NotFound as exc:
        raise NotFound(f"{what}: not found") from exc
    except (gex.Forbidden, gex.Unauthorized, aex.DefaultCredentialsError, aex.RefreshError) as exc:
        raise CredentialsError(f"{what}: credentials missing or refused ({type(exc).__name__})") from exc
    except (gex.ServerError, gex.TooManyRequests, gex.RetryError, requests.ConnectionError,
            requests.Timeout, ConnectionError) as exc:
        raise TransientError(f"{what}: {cause_of(exc)}") from exc
    except gex.GoogleAPICallError as exc:
        raise StoreError(f"{what}: {exc.code} {exc.message}") from exc
    except Exception as exc:
        if type(exc).__name__ == "DataCorruption":  # google.resumable_media.common.DataCorruption
            raise IntegrityError(f"{what}: crc32c mismatch") from exc
        if (translated := transport_error(what, exc)) is not None:  # e.g. ChunkedEncodingError
            raise translated from exc
        raise


class GcsStore:
    """Objects under ``gs://bucket/prefix``; ``client`` may be injected."""

    def __init__(self, bucket: str, prefix: str = "", *, options: StoreOptions | None = None,
                 client: Any = None) -> None:
        cut_headers_are_errors()
        self.options = options or StoreOptions()
        self.prefix = prefix.strip("/")
        self.url = f"gs://{bucket}/{self.prefix}".rstrip("/")
        self._client = client or self._make_client()
        self._bucket = self._client.bucket(bucket)
        from google.cloud.storage.retry import DEFAULT_RETRY

        # The library's delays grow to 60 s: a store back after a burst would wait a minute for nothing.
        self._retry = DEFAULT_RETRY.with_delay(initial=0.5, maximum=4.0).with_deadline(self.options.deadline)
        self._timeout = (self.options.connect_timeout, self.options.read_timeout)

    def _make_client(self) -> Any:
        from google.cloud import storage

        endpoint = self.options.endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST")
        if endpoint:
            from google.auth.credentials import AnonymousCredentials

            return storage.Client(project="spotguard-emulator", credentials=AnonymousCredentials(),
                                  client_options={"api_endpoint": endpoint})
        with _translate(f"storage {self.url}"):
            return storage.Client()

    def _blob(self, key: str, *, large: bool = False) -> Any:
        chunk = self.options.part_size // (256 * 1024) * (256 * 1024) if large else None
        return self._bucket.blob(join_key(self.prefix, key), chunk_size=chunk or None)

    def put_file(self, key: str, path: Path, *, sha256: str | None = None, size: int | None = None,
                 interrupt: Callable[[int], None] | None = None) -> int:
        """With ``sha256`` the bytes are read once and verified while sent (see :mod:`._verify`):
        a mismatch raises ``IntegrityError`` before the object is finalised."""
        size = size if size is not None else Path(path).stat().st_size
        blob = self._blob(key, large=size > self.options.part_size)
        if sha256 is None:
            with _translate(f"{self.url}: upload {key}"):
                blob.upload_from_filename(str(path), checksum="crc32c", retry=self._retry, timeout=self._timeout)
            return size
        blob.metadata = {"sha256": sha256}
        window = blob.chunk_size or size  # a retry rewinds at most one chunk
        with VerifyingReader(path, sha256, size, window=max(window, 1), interrupt=interrupt) as body, \
                _translate(f"{self.url}: upload {key}"):
            blob.upload_from_file(body, size=size, checksum="crc32c", retry=self._retry, timeout=self._timeout)
        return size

    def put_bytes(self, key: str, data: bytes) -> None:
        with _translate(f"{self.url}: put {key}"):
            self._blob(key).upload_from_string(data, checksum="crc32c", retry=self._retry, timeout=self._timeout)

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if no object is there (``ifGenerationMatch=0``): True when this call
        wrote it."""
        from google.api_core import exceptions as gex

        with _translate(f"{self.url}: put {key} if absent"):
            try:
                self._blob(key).upload_from_string(data, checksum="crc32c", if_generation_match=0,
                                                   retry=self._retry, timeout=self._timeout)
            except gex.PreconditionFailed:
                return False
        return True

    def get_file(self, key: str, path: Path, *, max_size: int | None = None) -> None:
        """Large objects are read as ``part_size`` ranges (of the size checked) by ``concurrency``
        threads, then the whole file's CRC32C is checked against the object's."""
        what = f"{self.url}: download {key}"
        with _translate(what):
            blob = self._bucket.get_blob(join_key(self.prefix, key), retry=self._retry, timeout=self._timeout)
            if blob is None:
                raise NotFound(f"{what}: not found")
            check_size(what, blob.size, max_size)
            if (blob.size or 0) <= self.options.part_size:
                with open(path, "wb") as raw:
                    return blob.download_to_file(BoundedWriter(raw, max_size, what), checksum="crc32c",
                                                 retry=self._retry, timeout=self._timeout)
            from google.cloud.storage import transfer_manager

            transfer_manager.download_chunks_concurrently(
                blob, str(path), chunk_size=self.options.part_size, worker_type=transfer_manager.THREAD,
                max_workers=self.options.concurrency, download_kwargs={"retry": self._retry, "timeout": self._timeout},
                crc32c_checksum=True)

    def get_bytes(self, key: str, *, max_size: int = MAX_SMALL_BYTES) -> bytes:
        what, buffer = f"{self.url}: get {key}", io.BytesIO()
        with _translate(what):
            self._blob(key).download_to_file(BoundedWriter(buffer, max_size, what), checksum="crc32c",
                                             retry=self._retry, timeout=self._timeout)
        return buffer.getvalue()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start`` (one ranged GET; the caller checks them)."""
        what = f"{self.url}: get {key} [{start}, +{length})"
        if not length:
            return b""
        with _translate(what):
            data = self._blob(key).download_as_bytes(start=start, end=start + length - 1, checksum=None,
                                                     retry=self._retry, timeout=self._timeout)
        return check_range(what, data, length)

    def exists(self, key: str) -> bool:
        with _translate(f"{self.url}: head {key}"):
            return self._blob(key).exists(retry=self._retry, timeout=self._timeout)

    def holds(self, key: str, path: Path, sha256: str, size: int) -> bool:
        """The object's size and GCS's own MD5 of it (a composite object has none: not proven)
        against the local file's."""
        import base64

        from spotguard.storage._verify import file_digest

        with _translate(f"{self.url}: head {key}"):
            blob = self._bucket.get_blob(join_key(self.prefix, key), retry=self._retry, timeout=self._timeout)
        if blob is None or blob.size != size or not blob.md5_hash:
            return False
        return base64.b64decode(blob.md5_hash) == file_digest(path, "md5")

    def list(self, prefix: str) -> Iterator[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        with _translate(f"{self.url}: list {prefix}"):
            for blob in self._client.list_blobs(self._bucket, prefix=base + prefix, retry=self._retry, timeout=self._timeout):
                yield blob.name[len(base):]

    def delete(self, keys: Iterable[str]) -> None:
        import google.api_core.exceptions as gex

        for key in keys:
            with _translate(f"{self.url}: delete {key}"):
                try:
                    self._blob(key).delete(retry=self._retry, timeout=self._timeout)
                except gex.NotFound:
                    pass

    def check(self) -> None:
        try:
            with _translate(f"storage {self.url}"):
                self._bucket.reload(retry=self._retry,
                                    timeout=self._timeout)
        except NotFound as exc:
            raise NotFound(f"storage {self.url}: bucket {self._bucket.name!r} does not exist") from exc
