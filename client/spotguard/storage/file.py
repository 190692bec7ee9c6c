"""A store in a local (or network-mounted) directory: the embedded default, ``file:///dir``.

Puts are atomic the POSIX way: write ``<dir>/.tmp-<name>-<random>``, ``fsync``, ``rename`` over the
final name, ``fsync`` the directory. A crash leaves at most a ``.tmp-`` file, which :meth:`list`
hides and :meth:`clean_incomplete` removes. Directories are created 0700 and files 0600: checkpoints
are the owner's data. Errors: ``NotFound`` for missing keys; other ``OSError`` becomes ``StoreError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

from spotguard._fsync import fsync_dir
from spotguard.storage._bounded import BoundedWriter, read_bounded
from spotguard.storage.base import (
    MAX_SMALL_BYTES,
    IntegrityError,
    NotFound,
    StoreError,
    check_key,
    check_range,
    check_size,
)

__all__ = ["FileStore", "TMP_PREFIX", "atomic_write", "fsync_dir", "make_private_dirs"]

TMP_PREFIX = ".tmp-"


def make_private_dirs(path: Path) -> None:
    """``mkdir -p`` with mode 0700 on every directory it creates (``os.makedirs`` applies the mode
    only to the last one)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            pass


def atomic_write(final: Path, write: Callable[[BinaryIO], object]) -> None:
    """Create or replace ``final`` atomically: ``write(file)`` into a private ``.tmp-`` sibling,
    fsync it, rename it over ``final``, fsync the directory."""
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + final.name + "-", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


class FileStore:
    """Objects are files under ``root``; the key is the relative path."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _atomic_write(self, key: str, write: Callable[[BinaryIO], object]) -> None:
        final = self._path(key)
        make_private_dirs(final.parent)
        atomic_write(final, write)

    def put_file(self, key: str, path: Path, *, sha256: str | None = None, size: int | None = None,
                 interrupt: Callable[[int], None] | None = None) -> int:
        """With ``sha256`` and ``size`` the copy is verified as it is written (see :mod:`._verify`):
        a mismatch raises ``IntegrityError`` and the temporary file is removed, never renamed."""
        from spotguard.storage._verify import VerifyingReader

        verified = sha256 is not None and size is not None
        try:
            with (VerifyingReader(path, sha256, size, interrupt=interrupt) if verified
                  else open(path, "rb")) as src:
                self._atomic_write(key, lambda out: shutil.copyfileobj(src, out, 4 * 1024 * 1024))
            return size if verified else os.path.getsize(path)
        except FileNotFoundError as exc:
            raise StoreError(f"{path}: no such file") from exc
        except OSError as exc:
            raise StoreError(f"{self.url}: cannot write {key}: {exc.strerror}") from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self._atomic_write(key, lambda out: out.write(data))
        except OSError as exc:
            raise StoreError(f"{self.url}: cannot write {key}: {exc.strerror}") from exc

    @contextlib.contextmanager
    def _reading(self, key: str, what: str, max_size: int | None) -> Iterator[BinaryIO]:
        """``key`` opened for reading, without blocking (a FIFO), refused unless a regular file
        (a device such as ``/dev/zero`` is endless) no larger than ``max_size``."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"{self.url}: no object {key}") from exc
        except OSError as exc:
            raise StoreError(f"{what}: {exc.strerror}") from exc
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise IntegrityError(f"{what}: not a regular file; refused")
        with open(fd, "rb") as src:
            check_size(what, info.st_size, max_size)
            try:
                yield src
            except OSError as exc:
                raise StoreError(f"{what}: {exc.strerror}") from exc

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if no object is there (a hard link of the fsynced file, which fails
        on an existing name): True when this call wrote it."""
        final = self._path(key)
        try:
            make_private_dirs(final.parent)
            fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + final.name + "-", dir=final.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    return False
            finally:
                Path(tmp).unlink(missing_ok=True)
            fsync_dir(final.parent)
            return True
        except OSError as exc:
            raise StoreError(f"{self.url}: cannot write {key}: {exc.strerror}") from exc

    def get_file(self, key: str, path: Path, *, max_size: int | None = None) -> None:
        """Copies at most ``max_size`` bytes: a file that grows while it is read is refused too."""
        what = f"{self.url}: read {key}"
        with self._reading(key, what, max_size) as src, open(path, "wb") as raw:
            shutil.copyfileobj(src, BoundedWriter(raw, max_size, what), 4 * 1024 * 1024)

    def get_bytes(self, key: str, *, max_size: int = MAX_SMALL_BYTES) -> bytes:
        what = f"{self.url}: read {key}"
        with self._reading(key, what, max_size) as src:
            return read_bounded(src.read, max_size, what)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start``; IntegrityError when the object is shorter."""
        what = f"{self.url}: read {key} [{start}, +{length})"
        with self._reading(key, what, None) as src:
            src.seek(start)
            data = src.read(length)  # a regular file: short only at its end
        return check_range(what, data, length)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def holds(self, key: str, path: Path, sha256: str, size: int) -> bool:
        """The object's size, then its bytes hashed (a local read: the store is a directory)."""
        import hashlib

        what = f"{self.url}: read {key}"
        try:
            with self._reading(key, what, size) as src:
                if os.fstat(src.fileno()).st_size != size:
                    return False
                return hashlib.file_digest(src, "sha256").hexdigest() == sha256
        except (NotFound, IntegrityError):
            return False

    def list(self, prefix: str) -> Iterator[str]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            rel = os.path.relpath(dirpath, self.root)
            for name in sorted(filenames):
                key = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
                if not name.startswith(TMP_PREFIX) and key.startswith(prefix):
                    yield key

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            try:
                self._path(key).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StoreError(f"{self.url}: cannot delete {key}: {exc.strerror}") from exc

    def clean_incomplete(self, older_than: float) -> int:
        """Remove ``.tmp-`` files older than ``older_than`` seconds (crashed puts); return the count."""
        cutoff, removed = time.time() - older_than, 0
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                path = Path(dirpath) / name
                if name.startswith(TMP_PREFIX) and path.stat().st_mtime < cutoff:
                    path.unlink(missing_ok=True)
                    removed += 1
        return removed

    def check(self) -> None:
        try:
            make_private_dirs(self.root)
            probe = tempfile.NamedTemporaryFile(prefix=TMP_PREFIX + "check-", dir=self.root)
            probe.close()
        except OSError as exc:
            reason = "not writable" if exc.errno in (errno.EACCES, errno.EROFS) else exc.strerror
            raise StoreError(f"storage {self.url}: {reason}") from exc
