"""The object-store contract every backend implements, and its errors (a store is built from its URL
by :func:`spotguard.storage.registry.open_store`, which sits above the backends).

A store holds opaque objects under ``str`` keys relative to the store's root (``objects/sha256/ab..``);
keys never start with ``/`` and never contain ``..`` segments. ``Path`` is never used for keys: it
mangles ``gs://`` and treats ``\\`` specially. Every put is atomic: a reader sees the whole object or
no object, never a prefix of one (object stores give this for free; :mod:`.file` renames).

Exceptions, translated once at each backend's boundary with ``raise ... from exc``::

    StoreError                 anything the store could not do
    ├── NotFound               the key (or the bucket / container) does not exist
    ├── CredentialsError       no credentials, or they were refused (401/403)
    ├── TransientError         timeouts, resets, 5xx, throttling: worth retrying later
    └── IntegrityError         bytes read back do not match their checksum

:class:`Interrupted` is no StoreError: a caller's ``interrupt`` hook raises it (a subclass) from
inside an upload's read, and every backend and :class:`.durable.Durable`'s retries let it pass as
itself.

Every backend ends its translation with :func:`transport_error`, so a reset, a truncated body or a
timeout raised by whatever layer (``urllib3``, ``requests``, ``http.client``, ``socket``, an SDK type
no rule names) is a :class:`TransientError` too: nothing raw escapes a store call.

Log noise is one line per cause: a translated error names the operation, the store and the cause
(``TransientError("s3://b/p: get k: ConnectionClosedError: ...")``, never a bare type name), and a
reply whose header block was cut short, which urllib3 logs with a traceback and then takes for a
whole reply (a 200 with an empty body), is an error of the request (:func:`cut_headers_are_errors`).

Every request is bounded: ``StoreOptions.connect_timeout`` / ``read_timeout`` (seconds, per socket
operation) and ``max_attempts`` are the defaults of every backend, set here and nowhere else.

The SDKs are imported lazily, by the backend that needs them, so ``import spotguard`` stays light.
"""

from __future__ import annotations

import logging
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

__all__ = [
    "CredentialsError",
    "IntegrityError",
    "MAX_SMALL_BYTES",
    "Interrupted",
    "NotFound",
    "Store",
    "StoreError",
    "StoreOptions",
    "TransientError",
    "check_key",
    "check_size",
    "cause_of",
    "cut_headers_are_errors",
    "transport_error",
    "join_key",
]


MAX_SMALL_BYTES = 64 * 1024 * 1024
"""The default bound of :meth:`Store.get_bytes`: small objects are pointers, manifests and notes."""


class Interrupted(Exception):
    """Base of what an ``interrupt`` hook raises to abandon an upload mid-file: never translated,
    never retried, and nothing is stored under the key (the transfer is aborted, not committed)."""


class StoreError(Exception):
    """The store could not do what was asked; the message is one line, without secrets."""


class NotFound(StoreError):
    """The key, bucket or container does not exist."""


class CredentialsError(StoreError):
    """Credentials are missing or were refused."""


class TransientError(StoreError):
    """A timeout, reset, throttle or server error: the same call may succeed later."""


class IntegrityError(StoreError):
    """Bytes read back do not match the checksum they were written with."""


@runtime_checkable
class Store(Protocol):
    """A flat key space of immutable-by-convention objects. Backends: file, s3, gcs, azure."""

    url: str
    """Where the store lives, e.g. ``s3://bucket/prefix``; never contains credentials."""

    def put_file(self, key: str, path: Path, *, sha256: str | None = None, size: int | None = None,
                 interrupt: Callable[[int], None] | None = None) -> int:
        """Upload ``path`` atomically under ``key``; return the bytes sent.

        ``sha256``/``size`` describe the file (stored as metadata where the backend allows it). When
        both are given the file is read once and hashed as it is sent; if those bytes do not hash to
        ``sha256`` the backend raises :class:`IntegrityError` and stores nothing under ``key``. The
        SDK's own transfer checksum (CRC32/CRC32C/MD5) guards the bytes on the wire. With both,
        ``interrupt(n)`` is called before each chunk of ``n`` bytes is read from ``path``; an
        :class:`Interrupted` it raises abandons the upload at once (nothing stored under ``key``)
        and propagates as itself."""

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object atomically."""

    def get_file(self, key: str, path: Path, *, max_size: int | None = None) -> None:
        """Download ``key`` into ``path`` (created or truncated). :class:`NotFound` when absent;
        :class:`IntegrityError` when the object is over ``max_size``: before any byte is written
        when the store says so, else at the first byte past it (:mod:`._bounded`)."""

    def get_bytes(self, key: str, *, max_size: int = MAX_SMALL_BYTES) -> bytes:
        """Read a small object whole. :class:`NotFound` when absent; :class:`IntegrityError` when
        it is over ``max_size`` (no more than ``max_size + 1`` bytes are read)."""

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if no object is there, atomically where the store can (S3
        ``If-None-Match``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match``, a hard link on a
        directory): True when this call wrote it. Optional: a store without it is written with
        :meth:`put_bytes`."""
        ...

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from offset ``start`` (a resharding load reads only the
        saved shards it needs); :class:`IntegrityError` if the object is shorter."""
        ...

    def exists(self, key: str) -> bool: ...

    def holds(self, key: str, path: Path, sha256: str, size: int) -> bool:
        """True only when the store proves that ``key`` holds the bytes of the local file ``path``
        (``size`` bytes hashing to ``sha256``) by a checksum it computed or checked itself: S3's
        ``ChecksumSHA256``, GCS's MD5, Azure's Content-MD5, the file store's bytes hashed. False when
        the object is absent, of another size, or nothing proves its content (then it is sent
        again: a content address names the bytes, it does not prove them)."""

    def list(self, prefix: str) -> Iterator[str]:
        """Every key starting with ``prefix``, in no promised order."""

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``; missing keys are not an error."""

    def check(self) -> None:
        """Prove at start-up that the bucket exists and the credentials work (one cheap request).

        Raises :class:`StoreError` whose message is one line naming the store and the problem."""


@dataclass(frozen=True)
class StoreOptions:
    """Backend knobs, read from the daemon's ``storage`` settings or given directly."""

    endpoint_url: str | None = None
    """S3-compatible endpoint, or an emulator for S3 / GCS / Azure."""
    concurrency: int = 8
    """Parallel parts per object (multipart / block uploads, ranged downloads)."""
    part_size: int = 64 * 1024 * 1024
    """Multipart part size in bytes; objects at most this large go in one request."""
    azure_account: str | None = None
    azure_connection_string: str | None = field(default=None, repr=False)
    """May hold an account key: kept out of ``repr`` and logs."""
    max_attempts: int = 8
    """Attempts per request inside the SDK (standard retry modes with backoff)."""
    connect_timeout: float = 5.0
    """Seconds to open a connection; an endpoint that does not answer is retried, not waited on."""
    read_timeout: float = 20.0
    """Seconds any one socket read may stall (botocore's default of 60 s is half an AWS notice)."""
    retry_seconds: float = 60.0
    """Seconds a restore (:func:`.fresh_node.restore_newer`) retries transient errors in all."""

    @property
    def deadline(self) -> float:
        """Seconds one call may spend in all its attempts, for SDKs that bound retries by time (GCS)."""
        return (self.connect_timeout + self.read_timeout) * self.max_attempts

    @classmethod
    def of(cls, settings: Any) -> "StoreOptions":
        """Options from any settings-like object (e.g. ``Settings.storage``); absent fields keep defaults.

        A pydantic ``SecretStr`` connection string is unwrapped here and nowhere else."""
        if settings is None or isinstance(settings, StoreOptions):
            return settings or cls()
        found: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            value = getattr(settings, name, None)
            if value is not None:
                found[name] = value.get_secret_value() if hasattr(value, "get_secret_value") else value
        return cls(**found)


_LOCAL_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSPORT_MODULES = ("urllib3", "requests", "http.client", "botocore", "s3transfer", "google", "azure")


def transport_error(what: str, exc: BaseException) -> StoreError | None:
    """The :class:`StoreError` for an exception no backend rule named, or None for a programming error.

    Socket-level failures (resets, timeouts, TLS, truncated bodies) and any exception of an SDK or
    transport package are transient; a local file that cannot be opened is a plain StoreError."""
    if isinstance(exc, (StoreError, Interrupted)) or not isinstance(exc, Exception):
        return None
    if isinstance(exc, _LOCAL_OS_ERRORS):
        return StoreError(f"{what}: {exc.strerror or type(exc).__name__}")
    module = type(exc).__module__
    if isinstance(exc, (OSError, socket.timeout)) or module.startswith(_TRANSPORT_MODULES) \
            or _raised_in(exc, _TRANSPORT_MODULES):  # an SDK's ValueError/KeyError on a torn reply
        return TransientError(f"{what}: {cause_of(exc)}")
    return None


def cause_of(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters, query strings masked: a signed
    URL's signature stays out of logs), or the type alone when the message is empty."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"\?[^\s'\")]*", "?...", text)[:200]
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (no message)"


class _CutHeaders(logging.Filter):
    """On urllib3's "Failed to parse headers" warning (logged, with a traceback, from inside
    ``getresponse``), raises ``ProtocolError`` there instead: the request fails and is retried like
    any cut reply, and the SDK's error names the operation, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Failed to parse headers"):
            from urllib3.exceptions import ProtocolError

            raise ProtocolError("the reply's header block was cut short or malformed")
        return True


def cut_headers_are_errors() -> None:
    """Install :class:`_CutHeaders` on urllib3's connection logger (once; every cloud backend calls
    it). The logger is set to WARNING at least, so that the check runs whatever the root level."""
    logger = logging.getLogger("urllib3.connection")
    if not any(isinstance(f, _CutHeaders) for f in logger.filters):
        logger.addFilter(_CutHeaders())
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)


def _raised_in(exc: BaseException, modules: tuple[str, ...]) -> bool:
    """Whether the innermost frame that raised ``exc`` belongs to one of ``modules``."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith(modules)


_BAD_KEY = re.compile(r"(^|/)\.\.?(/|$)|^/|//|\x00")


def check_size(what: str, size: int | None, max_size: int | None) -> None:
    """Refuse an object larger than its manifest says, before downloading it (a hostile bucket
    must not fill the disk)."""
    if max_size is not None and size is not None and size > max_size:
        raise IntegrityError(f"{what}: object is {size} bytes, its manifest says {max_size}")


def check_range(what: str, data: bytes, length: int) -> bytes:
    """``data`` if it is the ``length`` bytes a ranged read asked for (an object shorter than the
    range, or a reply cut short, is an :class:`IntegrityError`)."""
    if len(data) != length:
        raise IntegrityError(f"{what}: {len(data)} bytes where {length} were asked for")
    return data


def check_key(key: str) -> str:
    """Return ``key`` if it is a clean relative key; raise :class:`ValueError` otherwise."""
    if not isinstance(key, str) or not key or _BAD_KEY.search(key) or "\\" in key:
        raise ValueError(f"invalid store key {key!r}")
    return key


def join_key(prefix: str, key: str) -> str:
    """``prefix/key`` with exactly one slash; an empty prefix adds nothing."""
    check_key(key)
    return f"{prefix.strip('/')}/{key}" if prefix.strip("/") else key
