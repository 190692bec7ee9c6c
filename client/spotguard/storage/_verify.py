"""Hash what is sent, while it is sent: the reader every backend's ``put_file`` uploads through.

Hashing a file and then uploading it reads it twice; a file changed in between is stored under the
old content address and reported durable (issue 12.10). :class:`VerifyingReader` reads the file
once: the bytes the SDK sends are the bytes hashed. When the last of the ``size`` bytes the manifest
declares has been read, and before the SDK can send them (every SDK reads a whole part before it
sends it, and completes an object only after its last part), the digest is compared with the
manifest's; a mismatch, a short file or a failed read raises :class:`IntegrityError` from inside
``read``, so the SDK abandons the upload (multipart uploads are aborted, resumable ones never
finalised) and nothing appears under the wrong address.

SDK retries re-send bytes they already read: a non-seekable reader makes S3 and Azure buffer each
part; for SDKs that seek back (GCS resumable uploads rewind to the last acknowledged chunk) the
reader replays the last ``window`` bytes from memory, never from the file.

``interrupt(n)`` (if given) is called before each fresh read of ``n`` bytes from the file, so a
caller can pace a transfer (a bandwidth cap that holds inside a file) or abandon a multi-GB file
at its next chunk instead of after the whole file: its exception, a :class:`.base.Interrupted`,
aborts the upload as an IntegrityError does.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Callable

from spotguard.storage.base import IntegrityError, StoreError

__all__ = ["VerifyingReader"]


def file_digest(path: Path, algorithm: str) -> bytes:
    """The ``algorithm`` (hashlib's name) digest of the local file ``path``, read once."""
    with open(path, "rb") as src:
        return hashlib.file_digest(src, algorithm).digest()


def composite_sha256(path: Path, chunk: int) -> bytes:
    """S3's checksum of a multipart object sent in ``chunk``-byte parts: the sha256 of the parts'
    sha256 digests, computed here of the local file ``path``, read once."""
    outer = hashlib.sha256()
    with open(path, "rb", buffering=0) as src:
        while piece := src.read(chunk):
            outer.update(hashlib.sha256(piece).digest())
    return outer.digest()


class VerifyingReader(io.RawIOBase):
    """A read-once view of ``path`` that raises :class:`IntegrityError` unless its first ``size``
    bytes hash to ``sha256``. ``window`` > 0 makes it seekable back by up to that many bytes."""

    def __init__(self, path: Path, sha256: str, size: int, *, window: int = 0,
                 interrupt: Callable[[int], None] | None = None) -> None:
        super().__init__()
        try:
            self._file = open(path, "rb")  # noqa: SIM115 (closed by close())
        except OSError as exc:
            raise StoreError(f"{path}: cannot read ({exc.strerror})") from exc
        self.path, self.sha256, self.size, self.window = Path(path), sha256, size, window
        self.interrupt = interrupt
        self._digest = hashlib.sha256()
        self._read = 0          # bytes taken from the file (and hashed)
        self._pos = 0           # what the caller has consumed
        self._replay = b""      # the last ``window`` bytes read, starting at _read - len(_replay)
        if size == 0 and sha256 != hashlib.sha256(b"").hexdigest():
            self._file.close()
            raise IntegrityError(f"{path}: the manifest says 0 bytes but names a non-empty sha256")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.window > 0

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = {os.SEEK_SET: offset, os.SEEK_CUR: self._pos + offset, os.SEEK_END: self.size + offset}[whence]
        if not self.window or not self._read - len(self._replay) <= target <= self._read:
            raise OSError(f"{self.path}: cannot seek to {target} (replay window {self.window})")
        self._pos = target
        return target

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def read(self, n: int = -1) -> bytes:
        n = self.size - self._pos if n is None or n < 0 else min(n, self.size - self._pos)
        if n <= 0:
            return b""
        if self._pos < self._read:  # a retry rewound: replay from memory
            start = len(self._replay) - (self._read - self._pos)
            data = self._replay[start:start + n]
        else:
            data = self._fresh(n)
        self._pos += len(data)
        return data

    def _fresh(self, n: int) -> bytes:
        if self.interrupt is not None:
            self.interrupt(n)
        data = b""
        while len(data) < n:  # SDKs take a short read for the end of the stream
            try:
                more = self._file.read(n - len(data))
            except OSError as exc:
                raise IntegrityError(f"{self.path}: read failed mid-upload ({exc.strerror})") from exc
            if not more:
                raise IntegrityError(f"{self.path}: shorter than its manifest's {self.size} bytes "
                                     f"(changed after commit?)")
            data += more
        self._digest.update(data)
        self._read += len(data)
        if self.window:
            self._replay = (self._replay + data)[-self.window:]
        if self._read == self.size and self._digest.hexdigest() != self.sha256:
            raise IntegrityError(f"{self.path}: does not match its manifest's sha256 "
                                 f"(changed after commit?)")
        return data

    def close(self) -> None:
        self._file.close()
        super().close()
