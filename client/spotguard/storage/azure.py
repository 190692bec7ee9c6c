"""Azure Blob Storage: ``az://container/prefix`` or ``https://<account>.blob.core.windows.net/<container>/prefix``.

Block blobs are uploaded in ``options.part_size`` blocks with ``max_concurrency=options.concurrency``
and committed in one ``Put Block List``, so a blob appears whole or not at all; every block carries
a Content-MD5 the service checks (``validate_content``) and the file's sha256 is blob metadata.
Downloads use ranged, parallel reads, also MD5-validated.

Credentials: ``options.azure_connection_string`` (Azurite, or a key you chose to configure) else the
account URL with ``DefaultAzureCredential`` (managed identity, workload identity, CLI login...).
``azure.core`` exceptions are translated in :func:`_translate`: ``ResourceNotFoundError`` ->
``NotFound``, ``ClientAuthenticationError``/credential failures -> ``CredentialsError``, 5xx and
connection errors -> ``TransientError``.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from spotguard.storage._bounded import BoundedWriter
from spotguard.storage._verify import VerifyingReader
from spotguard.storage.base import (
    MAX_SMALL_BYTES,
    CredentialsError,
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

__all__ = ["AzureStore"]


@contextlib.contextmanager
def _translate(what: str):
    import azure.core.exceptions as aex

    try:
        yield
    except Interrupted:  # the caller's own abandonment: not a store failure
        raise
    except aex.ResourceNotFoundError as exc:
        raise NotFound(f"{what}: not found ({getattr(exc, 'error_code', None) or 404})") from exc
    except aex.ClientAuthenticationError as exc:
        code = getattr(exc, "error_code", None) or "auth"
        raise CredentialsError(f"{what}: credentials missing or refused ({code})") from exc
    except (aex.ServiceRequestError, aex.ServiceResponseError) as exc:
        raise TransientError(f"{what}: {cause_of(exc)}") from exc
    except aex.HttpResponseError as exc:
        status, code = exc.status_code or 0, getattr(exc, "error_code", None)
        if status in (401, 403):
            raise CredentialsError(f"{what}: {status} {code}") from exc
        if status == 0:  # no status: the reply was cut (an IncompleteRead wrapped by azure-core)
            raise TransientError(f"{what}: reply cut short ({type(exc).__name__})") from exc
        if status >= 500 or status in (408, 429):
            raise TransientError(f"{what}: {status} {code}") from exc
        raise StoreError(f"{what}: {status} {code}") from exc
    except Exception as exc:
        if type(exc).__name__ == "CredentialUnavailableError":
            raise CredentialsError(f"{what}: no Azure credential available") from exc
        if (translated := transport_error(what, exc)) is not None:
            raise translated from exc
        raise


class AzureStore:
    """Objects under one container and prefix; ``container_client`` may be injected."""

    def __init__(self, container: str, prefix: str = "", *, options: StoreOptions | None = None,
                 container_client: Any = None) -> None:
        cut_headers_are_errors()
        self.options = options or StoreOptions()
        self.prefix = prefix.strip("/")
        self.url = f"az://{container}/{self.prefix}".rstrip("/")
        self._container = container_client or self._make_client(container)

    def _make_client(self, container: str) -> Any:
        from azure.storage.blob import BlobServiceClient, ExponentialRetry

        # The SDK's default backoff starts at 15 s and triples: one 503 would cost a minute. Its
        # jitter (±3 s) would swamp a 0.5 s backoff: the first retry waited 0-3.5 s, 1.75 s on average.
        retry = ExponentialRetry(initial_backoff=0.5, increment_base=1.5, random_jitter_range=0.5,
                                 retry_total=max(0, self.options.max_attempts - 1))
        kwargs = {"max_block_size": self.options.part_size, "max_single_put_size": self.options.part_size,
                  "retry_policy": retry,
                  "connection_timeout": self.options.connect_timeout, "read_timeout": self.options.read_timeout}
        if self.options.azure_connection_string:
            service = BlobServiceClient.from_connection_string(self.options.azure_connection_string, **kwargs)
        else:
            account = self.options.azure_account
            if not account and not self.options.endpoint_url:
                raise ValueError(f"{self.url}: set storage.azure_account or azure_connection_string")
            from azure.identity import DefaultAzureCredential

            url = self.options.endpoint_url or f"https://{account}.blob.core.windows.net"
            service = BlobServiceClient(url, credential=DefaultAzureCredential(), **kwargs)
        return service.get_container_client(container)

    def _name(self, key: str) -> str:
        return join_key(self.prefix, key)

    def put_file(self, key: str, path: Path, *, sha256: str | None = None, size: int | None = None,
                 interrupt: Callable[[int], None] | None = None) -> int:
        """With ``sha256`` and ``size`` the bytes are read once and verified while sent (see
        :mod:`._verify`): a mismatch raises ``IntegrityError`` before the block list is committed."""
        verified = sha256 is not None and size is not None
        opener = (lambda: VerifyingReader(path, sha256, size, interrupt=interrupt)) if verified \
            else (lambda: open(path, "rb"))
        with _translate(f"{self.url}: upload {key}"), opener() as data:
            self._container.upload_blob(self._name(key), data, length=size, overwrite=True, validate_content=True,
                                        max_concurrency=self.options.concurrency,
                                        metadata={"sha256": sha256} if sha256 else None)
        return size if size is not None else Path(path).stat().st_size

    def put_bytes(self, key: str, data: bytes) -> None:
        with _translate(f"{self.url}: put {key}"):
            self._container.upload_blob(self._name(key), data, overwrite=True, validate_content=True)

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if no blob is there (``overwrite=False``: ``If-None-Match: *``): True
        when this call wrote it."""
        from azure.core.exceptions import ResourceExistsError

        with _translate(f"{self.url}: put {key} if absent"):
            try:
                self._container.upload_blob(self._name(key), data, overwrite=False, validate_content=True)
            except ResourceExistsError:
                return False
        return True

    def get_file(self, key: str, path: Path, *, max_size: int | None = None) -> None:
        what = f"{self.url}: download {key}"
        with _translate(what):
            stream = self._container.download_blob(self._name(key), validate_content=True,
                                                   max_concurrency=self.options.concurrency)
            check_size(what, stream.size, max_size)
            with open(path, "wb") as raw:
                stream.readinto(BoundedWriter(raw, max_size, what))

    def get_bytes(self, key: str, *, max_size: int = MAX_SMALL_BYTES) -> bytes:
        what, buffer = f"{self.url}: get {key}", io.BytesIO()
        with _translate(what):
            stream = self._container.download_blob(self._name(key), validate_content=True)
            check_size(what, stream.size, max_size)
            stream.readinto(BoundedWriter(buffer, max_size, what))
        return buffer.getvalue()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start`` (one ranged GET; the caller checks them)."""
        what = f"{self.url}: get {key} [{start}, +{length})"
        if not length:
            return b""
        with _translate(what):
            data = self._container.download_blob(self._name(key), offset=start, length=length).readall()
        return check_range(what, data, length)

    def exists(self, key: str) -> bool:
        with _translate(f"{self.url}: head {key}"):
            return self._container.get_blob_client(self._name(key)).exists()

    def holds(self, key: str, path: Path, sha256: str, size: int) -> bool:
        """The blob's size and Content-MD5 (the service's own for a blob put in one request; a
        blob committed from blocks has none unless its writer set one) against the local file's."""
        import azure.core.exceptions as aex

        from spotguard.storage._verify import file_digest

        try:
            with _translate(f"{self.url}: head {key}"):
                props = self._container.get_blob_client(self._name(key)).get_blob_properties()
        except (NotFound, aex.ResourceNotFoundError):
            return False
        md5 = props.content_settings.content_md5
        if props.size != size or not md5:
            return False
        return bytes(md5) == file_digest(path, "md5")

    def list(self, prefix: str) -> Iterator[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        with _translate(f"{self.url}: list {prefix}"):
            for name in self._container.list_blob_names(name_starts_with=base + prefix):
                yield name[len(base):]

    def delete(self, keys: Iterable[str]) -> None:
        import azure.core.exceptions as aex

        for key in keys:
            with _translate(f"{self.url}: delete {key}"):
                try:
                    self._container.delete_blob(self._name(key))
                except aex.ResourceNotFoundError:
                    pass

    def check(self) -> None:
        try:
            with _translate(f"storage {self.url}"):
                self._container.get_container_properties()
        except NotFound as exc:
            raise NotFound(f"storage {self.url}: container does not exist") from exc
