"""Amazon S3 and S3-compatible stores (MinIO, R2, moto): ``s3://bucket/prefix``.

Uploads go through s3transfer (``upload_file``) with a tuned :class:`TransferConfig`: parts of
``options.part_size`` bytes, ``options.concurrency`` in flight, so one large tensor file saturates the
link. S3 checks what it receives: an object sent in one request (``put_bytes``, and ``put_file`` below
``part_size``) carries its expected sha256 (``x-amz-checksum-sha256``; the content address for
checkpoint objects), so S3 refuses bytes that are not those the manifest names; every part of a
multipart upload carries its sha256 (``ChecksumAlgorithm``), which S3 verifies, so the object's
composite ``ChecksumSHA256`` (the sha256 of the parts' sha256s) proves its bytes as well: an
unchanged large file (frozen weights) is then recognised and not sent again (:meth:`S3Store.holds`).
The per-part hashing costs the upload about 0.7 s of CPU per GiB (hashlib with SHA-NI), against a
re-send of every large file at every step with a CRC32 per part. The file's sha256 also travels as
``x-amz-meta-sha256``. Retries are botocore's ``standard`` mode, every request bounded by
``options.connect_timeout``/``read_timeout``. Credentials come
from boto3's default chain only and are never logged.

botocore exceptions are translated in :func:`_translate`: 404/NoSuchKey/NoSuchBucket -> ``NotFound``,
401/403/no credentials -> ``CredentialsError``, 5xx/throttling/connection errors -> ``TransientError``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from spotguard.storage._bounded import BoundedWriter, read_bounded
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

__all__ = ["S3Store"]

log = logging.getLogger(__name__)

_NOT_FOUND = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
_DENIED = {"401", "403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
           "InvalidToken", "AllAccessDisabled"}


@contextlib.contextmanager
def _translate(what: str):
    """Turn botocore/s3transfer exceptions into :mod:`.base` errors, once, here."""
    import botocore.exceptions as bex

    try:
        yield
    except Interrupted:  # the caller's own abandonment: not a store failure
        raise
    except bex.ClientError as exc:
        err = exc.response.get("Error", {})
        code, status = str(err.get("Code", "")), exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        msg = f"{what}: {code or status} {err.get('Message', '')}".strip()
        if code in _NOT_FOUND or status == 404:
            raise NotFound(msg) from exc
        if code in _DENIED or status in (401, 403):
            raise CredentialsError(msg) from exc
        if status >= 500 or status == 429 or "Throttl" in code or "SlowDown" in code:
            raise TransientError(msg) from exc
        raise StoreError(msg) from exc
    except (bex.NoCredentialsError, bex.PartialCredentialsError) as exc:
        raise CredentialsError(f"{what}: no AWS credentials found") from exc
    except (bex.ConnectionError, bex.HTTPClientError, bex.ReadTimeoutError) as exc:
        raise TransientError(f"{what}: {cause_of(exc)}") from exc
    except KeyError as exc:  # s3transfer reading a reply a proxy truncated (no ContentLength)
        raise TransientError(f"{what}: malformed reply (no {exc})") from exc
    except Exception as exc:  # s3transfer wraps failures of parts in its own types
        if type(exc).__module__.startswith(("s3transfer", "boto3.exceptions")):
            cause = exc.__cause__ or exc.__context__
            if cause is not None and cause is not exc:
                with _translate(what):
                    raise cause
            raise TransientError(f"{what}: {exc}") from exc
        if (translated := transport_error(what, exc)) is not None:  # e.g. urllib3 ProtocolError
            raise translated from exc
        raise


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


class S3Store:
    """Objects under ``s3://bucket/prefix``; ``client`` may be injected (tests, custom sessions)."""

    def __init__(self, bucket: str, prefix: str = "", *, options: StoreOptions | None = None,
                 client: Any = None) -> None:
        cut_headers_are_errors()
        self.options = options or StoreOptions()
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._client = client or self._make_client()
        self._transfer = self._make_transfer_config()

    def _make_client(self) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            retries={"mode": "standard", "max_attempts": self.options.max_attempts},
            connect_timeout=self.options.connect_timeout,
            read_timeout=self.options.read_timeout,
            tcp_keepalive=True,
            max_pool_connections=max(10, self.options.concurrency * 2),
            request_checksum_calculation="when_supported",
            response_checksum_validation="when_supported",
        )
        return boto3.session.Session().client("s3", endpoint_url=self.options.endpoint_url, config=config)

    def _make_transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.options.part_size,
            multipart_chunksize=self.options.part_size,
            max_concurrency=self.options.concurrency,
            use_threads=True,
        )

    def _key(self, key: str) -> str:
        return join_key(self.prefix, key)

    def put_file(self, key: str, path: Path, *, sha256: str | None = None, size: int | None = None,
                 interrupt: Callable[[int], None] | None = None) -> int:
        """With ``sha256`` and ``size`` the bytes are read once and verified while sent (see
        :mod:`._verify`): a mismatch aborts the multipart upload and raises ``IntegrityError``."""
        extra: dict[str, Any] = {"ChecksumAlgorithm": "CRC32" if sha256 is None else "SHA256"}
        if sha256 is None or size is None:
            with _translate(f"{self.url}: upload {key}"):
                self._client.upload_file(str(path), self.bucket, self._key(key), ExtraArgs=extra,
                                         Config=self._transfer)
            return Path(path).stat().st_size
        extra["Metadata"] = {"sha256": sha256}
        if size < self.options.part_size:  # one PutObject: S3 checks the bytes against the hash
            extra = {"Metadata": extra["Metadata"], "ChecksumSHA256": _b64(bytes.fromhex(sha256))}
        with VerifyingReader(path, sha256, size, interrupt=interrupt) as body, \
                _translate(f"{self.url}: upload {key}"):
            self._client.upload_fileobj(body, self.bucket, self._key(key), ExtraArgs=extra,
                                        Config=self._transfer)
        return size

    def put_bytes(self, key: str, data: bytes) -> None:
        with _translate(f"{self.url}: put {key}"):
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                    ChecksumSHA256=_b64(hashlib.sha256(data).digest()))

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if no object is there (``If-None-Match: *``, atomic in S3): True when
        this call wrote it. A store that does not implement the condition (501) is written anyway."""
        import botocore.exceptions as bex

        with _translate(f"{self.url}: put {key} if absent"):
            try:
                self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*",
                                        ChecksumSHA256=_b64(hashlib.sha256(data).digest()))
            except bex.ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                if status != 501 and code != "NotImplemented":
                    raise
                self.put_bytes(key, data)
        return True

    def get_file(self, key: str, path: Path, *, max_size: int | None = None) -> None:
        what = f"{self.url}: download {key}"
        with _translate(what):
            if max_size is not None:
                head = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
                check_size(what, head.get("ContentLength"), max_size)
            with open(path, "wb") as raw:
                self._client.download_fileobj(self.bucket, self._key(key), BoundedWriter(raw, max_size, what),
                                              Config=self._transfer)

    def get_bytes(self, key: str, *, max_size: int = MAX_SMALL_BYTES) -> bytes:
        what = f"{self.url}: get {key}"
        with _translate(what):
            reply = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            with contextlib.closing(reply["Body"]) as body:
                if reply.get("ContentLength") is None:  # S3 always sends it: the reply's head was cut
                    raise TransientError(f"{what}: reply without Content-Length (its header block was cut short)")
                check_size(what, reply.get("ContentLength"), max_size)
                return read_bounded(body.read, max_size, what)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start`` (one ranged GET)."""
        what = f"{self.url}: get {key} [{start}, +{length})"
        if not length:
            return b""
        with _translate(what):
            reply = self._client.get_object(Bucket=self.bucket, Key=self._key(key),
                                            Range=f"bytes={start}-{start + length - 1}")
            with contextlib.closing(reply["Body"]) as body:
                return check_range(what, read_bounded(body.read, length, what), length)

    def exists(self, key: str) -> bool:
        try:
            with _translate(f"{self.url}: head {key}"):
                self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except NotFound:
            return False

    def holds(self, key: str, path: Path, sha256: str, size: int) -> bool:
        """The size, and S3's own ``ChecksumSHA256``: of the whole object (one sent in one
        request: S3 checked the bytes against it), or composite (a multipart object whose parts S3
        checked against their sha256s), compared with the same composite of the local file in the
        parts :meth:`put_file` would send it in; else its ETag where that is the MD5 S3 computed of
        the bytes (one request, not SSE-KMS) against the local file's. A multipart object with a
        CRC32 per part (sent before) or parts of another size is not proven: sent again."""
        from spotguard.storage._verify import file_digest

        try:
            with _translate(f"{self.url}: head {key}"):
                head = self._client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
        except NotFound:
            return False
        if head.get("ContentLength") != size:
            return False
        if head.get("ChecksumSHA256"):
            got = str(head["ChecksumSHA256"])
            return got == _b64(bytes.fromhex(sha256)) or self._composite_matches(path, size, got)
        etag = str(head.get("ETag", "")).strip('"')
        return re.fullmatch(r"[0-9a-fA-F]{32}", etag) is not None and bytes.fromhex(etag) == file_digest(path, "md5")

    def _composite_matches(self, path: Path, size: int, got: str) -> bool:
        """Whether ``got`` (S3's ``<base64>-<parts>``; some emulators leave the count out) is the
        composite sha256 of ``path`` in the parts s3transfer sends it in."""
        from s3transfer.utils import ChunksizeAdjuster

        from spotguard.storage._verify import composite_sha256

        if size < self.options.part_size:
            return False  # sent in one request: only the whole object's sha256 proves it
        chunk = ChunksizeAdjuster().adjust_chunksize(self.options.part_size, size)
        value, _, count = got.partition("-")
        if count and count != str(-(-size // chunk)):
            return False
        return value == _b64(composite_sha256(path, chunk))

    def list(self, prefix: str) -> Iterator[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix)
        with _translate(f"{self.url}: list {prefix}"):
            for page in pages:
                for item in page.get("Contents", ()):
                    yield item["Key"][len(base):]

    def delete(self, keys: Iterable[str]) -> None:
        batch = [{"Key": self._key(k)} for k in keys]
        for start in range(0, len(batch), 1000):
            with _translate(f"{self.url}: delete"):
                reply = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch[start:start + 1000], "Quiet": True})
            if reply.get("Errors"):
                first = reply["Errors"][0]
                raise StoreError(f"{self.url}: delete {first.get('Key')}: {first.get('Code')}")

    def clean_incomplete(self, older_than: float) -> int:
        """Abort multipart uploads under the prefix started more than ``older_than`` seconds ago."""
        cutoff = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=older_than)
        aborted = 0
        with _translate(f"{self.url}: list multipart uploads"):
            reply = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
            for upload in reply.get("Uploads", ()):
                if upload["Initiated"] < cutoff:
                    self._client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                        UploadId=upload["UploadId"])
                    aborted += 1
        return aborted

    def check(self) -> None:
        try:
            with _translate(f"storage {self.url}"):
                self._client.head_bucket(Bucket=self.bucket)
        except NotFound as exc:
            raise NotFound(f"storage {self.url}: bucket {self.bucket!r} does not exist") from exc
        except CredentialsError as exc:
            raise CredentialsError(f"storage {self.url}: credentials missing or refused ({exc})") from exc
