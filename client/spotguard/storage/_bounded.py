"""Reads bounded by the size the caller expects, on every backend.

A store is untrusted on restore: its listing or ``HEAD`` may say one size and its body be endless (a
``file://`` object that is a symlink to ``/dev/zero``, a server that ignores its own
``Content-Length``). So no backend trusts a size it was told: every byte of a download goes through
a :class:`BoundedWriter`, and a small object is read with at most ``max_size + 1`` bytes asked for
(:func:`read_bounded`). Going over raises :class:`.base.IntegrityError` at once: nothing beyond
``max_size`` is ever written to disk or held in memory.
"""

from __future__ import annotations

import io
from typing import BinaryIO, Callable

from spotguard.storage.base import IntegrityError

__all__ = ["BoundedWriter", "read_bounded", "too_large"]


def too_large(what: str, max_size: int) -> IntegrityError:
    return IntegrityError(f"{what}: object is larger than the {max_size} bytes expected; refused")


class BoundedWriter(io.RawIOBase):
    """A writable, seekable view of ``out`` that refuses any write ending past ``max_size`` (the
    SDKs' parallel downloads seek and write ranges: every range is checked)."""

    def __init__(self, out: BinaryIO, max_size: int | None, what: str) -> None:
        super().__init__()
        self.out, self.max_size, self.what = out, max_size, what

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        size = memoryview(data).nbytes
        if self.max_size is not None and self.out.tell() + size > self.max_size:
            raise too_large(self.what, self.max_size)
        self.out.write(data)
        return size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.out.seek(offset, whence)

    def tell(self) -> int:
        return self.out.tell()

    def flush(self) -> None:
        self.out.flush()


def read_bounded(read: Callable[[int], bytes], max_size: int, what: str) -> bytes:
    """Read at most ``max_size`` bytes with ``read(n)`` (a file's or an HTTP body's), raising
    :func:`too_large` when there are more: ``max_size + 1`` bytes are asked for, never more."""
    chunks, total = [], 0
    while total <= max_size:
        chunk = read(max_size + 1 - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > max_size:
        raise too_large(what, max_size)
    return b"".join(chunks)
