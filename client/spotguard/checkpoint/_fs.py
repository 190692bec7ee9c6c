"""Small file-system helpers with the durability the commit protocol needs.

Every file is created ``O_EXCL`` with mode 0600 and every directory with 0700: checkpoints hold model
weights and must stay private to their owner. Writes go straight from the caller's memory in large
chunks (``os.write`` releases the GIL; ``O_DIRECT`` from page-aligned staging buffers), and
directories are fsynced after entries change, because a rename is only durable once its parent
directory is.

Integrity: every file gets its sha256 (the content address the buckets store it under) and, for the
local restore, a 64-bit XXH3 of each :data:`CHUNK_BYTES` chunk (:func:`digests_of`). A restore reads the
chunks in several threads (:class:`FileReader`) and checks each one as soon as it is read, so
verification overlaps the reading. XXH3 (the ``xxhash`` package) hashes 1 GiB in 0.10 s on one core
here, zlib's crc32 (the check of the checkpoints written just before it, still read) in 0.27 s and
sha256 with SHA-NI in 0.73 s; per-chunk values need no ordering between threads. A file without
either (written before, or by DCP) is checked against its sha256.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from spotguard._fsync import fsync_dir

__all__ = [
    "CHUNK_BYTES",
    "fsync_dir",
    "mkdir_private",
    "open_new",
    "write_all",
    "start_writeback",
    "write_file",
    "sha256_of",
    "digests_of",
    "FileReader",
    "remove_tree",
    "free_bytes",
    "is_enospc",
]

CHUNK_BYTES = 16 << 20
"""Largest single ``os.write``/``readinto``: big enough to stream, small enough to stay interruptible."""


def mkdir_private(path: Path) -> None:
    """Create ``path`` with mode 0700 (the umask cannot widen it)."""
    os.mkdir(path, 0o700)


def open_new(path: Path) -> int:
    """A write-only fd of a file that did not exist before, mode 0600."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def _flat(data: memoryview) -> memoryview:
    return data.cast("B") if data.format != "B" or data.ndim != 1 else data


def write_all(fd: int, data: memoryview, pace: Callable[..., Any] | None = None) -> None:
    """Write every byte of ``data`` (``os.write`` may write less than asked); each chunk's write
    goes through ``pace(fn, *args)`` when given (see :class:`~._workers.Throttle`).

    ``data`` of :data:`DIRECT_MIN_BYTES` or more that starts on a page boundary (a staging buffer, a
    pinned chunk), written at a page-aligned file offset, is written with ``O_DIRECT`` up to its last
    whole page: the disk reads the buffer itself, with no copy into the page cache and no write-back
    to wait for. Measured here: 1.2-2.5x the throughput of buffered writes + fsync, and less CPU taken
    from training. The tail, and every write on a file system that refuses ``O_DIRECT``, goes through
    the page cache as before; fsync is needed either way. The fd leaves as it came, without
    ``O_DIRECT``: the next call may write unaligned data to the same file (the emergency path streams
    a file's tensors through the same fd, chunk after chunk)."""
    view, offset = _flat(data), 0
    direct_end = _direct_end(view)
    if direct_end and os.lseek(fd, 0, os.SEEK_CUR) % _PAGE:  # O_DIRECT needs an aligned file offset
        direct_end = 0
    if direct_end and not _set_direct(fd, True):
        direct_end = 0
    try:
        while offset < len(view):
            if direct_end and offset >= direct_end:
                _set_direct(fd, False)
                direct_end = 0
            piece = view[offset : min(offset + CHUNK_BYTES, direct_end or len(view))]
            try:
                offset += pace(os.write, fd, piece) if pace else os.write(fd, piece)
            except OSError as exc:  # O_DIRECT refused at write time (some FUSE/network file systems)
                if not direct_end or exc.errno != errno.EINVAL:
                    raise
                _set_direct(fd, False)
                direct_end = 0
    finally:
        if direct_end:
            _set_direct(fd, False)


DIRECT_MIN_BYTES = 1 << 20
_PAGE = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _direct_end(view: memoryview) -> int:
    """Bytes of ``view`` an ``O_DIRECT`` write may take: whole pages from a page-aligned start."""
    if not _O_DIRECT or len(view) < DIRECT_MIN_BYTES or _address(view) % _PAGE:
        return 0
    return len(view) - len(view) % _PAGE


def _set_direct(fd: int, on: bool) -> bool:
    """Switch ``O_DIRECT`` of ``fd``; False where the file system refuses it (tmpfs before Linux 6.6)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return on


def _load_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc: fsync alone still makes it durable
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start (not wait for) write-back of ``fd``'s dirty pages, so the disk works while the next
    segments are written (the emergency path's buffered writes from live memory); the fsync then
    finds little left to do."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def write_file(path: Path, data: bytes) -> None:
    """Create ``path`` holding ``data``, fsynced before returning."""
    fd = open_new(path)
    try:
        write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(data: memoryview | bytes, pace: Callable[..., Any] | None = None) -> str:
    """Hex sha256; hashlib releases the GIL for large buffers, so this runs beside writes. With
    ``pace``, hashed chunk by chunk, each chunk through ``pace(fn, *args)``."""
    if pace is None:
        return hashlib.sha256(data).hexdigest()
    digest, view = hashlib.sha256(), _flat(memoryview(data))
    for offset in range(0, len(view), CHUNK_BYTES):
        pace(digest.update, view[offset : offset + CHUNK_BYTES])
    return digest.hexdigest()


def digests_of(data: memoryview | bytes, pace: Callable[..., Any] | None = None) -> dict[str, Any]:
    """A file's digests for its manifest entry: ``sha256`` (hex, of the whole) and ``xxh3`` (one
    64-bit XXH3 per ``xxh3_chunk`` bytes, for the restore's verification; see the module docstring).
    Chunk by chunk, each through ``pace(fn, *args)`` when given; both run while the chunk is warm."""
    digests, view = Digests(), _flat(memoryview(data))
    for offset in range(0, len(view), CHUNK_BYTES):
        piece = view[offset : offset + CHUNK_BYTES]
        pace(digests.update, piece) if pace else digests.update(piece)
    return digests.entry()


class Digests:
    """:func:`digests_of` fed piece by piece, of any sizes (a stream written in chunks of its own):
    the same entry as for the whole at once."""

    def __init__(self) -> None:
        self._sha, self._xxh, self._filled, self._chunks = hashlib.sha256(), xxhash.xxh3_64(), 0, []

    def update(self, piece: memoryview) -> None:
        self._sha.update(piece)
        while len(piece):
            take = min(CHUNK_BYTES - self._filled, len(piece))
            self._xxh.update(piece[:take])
            self._filled, piece = self._filled + take, piece[take:]
            if self._filled == CHUNK_BYTES:
                self._chunks.append(self._xxh.intdigest())
                self._xxh.reset()
                self._filled = 0

    def entry(self) -> dict[str, Any]:
        chunks = self._chunks + ([self._xxh.intdigest()] if self._filled else [])
        return {"sha256": self._sha.hexdigest(), "xxh3": chunks, "xxh3_chunk": CHUNK_BYTES}


CHUNK_CHECKS: dict[str, Callable[[memoryview], int]] = {"xxh3": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}
"""The per-chunk checks a manifest entry may list (``<name>`` and ``<name>_chunk``), preferred first:
XXH3 since issue 31, zlib's crc32 in the checkpoints written just before it."""


class FileReader:
    """A file opened to fill a page-aligned buffer in spans, from several threads at once (``pread``):
    whole pages ``O_DIRECT`` where the file system takes it, the rest through the page cache.

    Why: a restore reads what the saves wrote ``O_DIRECT`` (not in the page cache), into buffers that
    become the staging copy. Reading them ``O_DIRECT`` too lets the disk fill the buffer with no copy
    out of the page cache, and spans read in parallel keep several requests in flight across the
    part's files: 1 GiB in 0.7 s here where one thread's buffered reads took 1.0-1.1 s (``dd``
    reading buffered with the kernel's read-ahead: 0.55 s). On a VM whose disk serves one request at
    a time, the request size sets the speed instead, and that follows how contiguous the memory read
    into is (benchmarks/README.md, "A third VM"); a bounce buffer in one huge page fixes that at
    the cost of a copy (:meth:`read`)."""

    def __init__(self, path: Path) -> None:
        self.path, self.direct_fd, self.direct = path, -1, False
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        self.block = _block_device(os.fstat(self.fd).st_dev)
        """On a block device (not tmpfs, NFS, FUSE or overlay): there the memory read into sets the
        size of the disk's ``O_DIRECT`` requests, so a bounce buffer pays (:meth:`read`)."""
        if _O_DIRECT:
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | _O_DIRECT)
                self.direct = True
            except OSError as exc:  # tmpfs before Linux 6.6, some FUSE file systems
                if exc.errno != errno.EINVAL:
                    self.close()
                    raise

    def read(self, out: memoryview, start: int, end: int, bounce: memoryview | None = None) -> None:
        """Fill ``out[start:end]`` from the file's bytes ``start:end``; a short file is an error.
        With ``bounce`` (a page-aligned buffer in one huge page, :func:`._hugepages.bounce_buffer`),
        the whole pages are read into it a buffer at a time and copied out: ``out`` may then be
        anywhere, and each request is as large as the bounce buffer."""
        view, pos = _flat(out), start
        if not 0 <= start <= end <= len(view):
            raise ValueError(f"bytes {start}:{end} do not fit a buffer of {len(view)}")
        to = _address(view)
        if self.direct and start % _PAGE == 0 and (bounce is not None or (to + start) % _PAGE == 0):
            direct_end = start + (end - start) // _PAGE * _PAGE
            src = _address(bounce) if bounce is not None else 0
            while pos < direct_end:
                try:
                    if bounce is None:
                        n = os.preadv(self.direct_fd, [view[pos:direct_end]], pos)
                    else:
                        n = os.preadv(self.direct_fd, [bounce[: min(len(bounce), direct_end - pos)]], pos)
                        ctypes.memmove(to + pos, src, n)  # releases the GIL, as preadv does
                except OSError as exc:  # O_DIRECT refused at read time: the page cache from now on
                    if exc.errno != errno.EINVAL:
                        raise
                    self.direct = False
                    break
                pos += n
                if not n or n % _PAGE:
                    break  # the end of a short file: the buffered loop below says so
        while pos < end:
            n = os.preadv(self.fd, [view[pos:end]], pos)
            if not n:
                raise EOFError(f"{self.path}: file shorter than {end} bytes")
            pos += n

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.lru_cache(maxsize=64)
def _block_device(dev: int) -> bool:
    return os.major(dev) != 0 and os.path.exists(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


def remove_tree(path: Path) -> None:
    """Remove a directory tree, ignoring entries that are already gone."""
    shutil.rmtree(path, ignore_errors=True)


def free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def is_enospc(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
