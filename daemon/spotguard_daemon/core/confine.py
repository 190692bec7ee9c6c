"""Open a committed checkpoint for upload without trusting anything in it.

A commit names a directory under ``checkpoint_root``; its ``manifest.json`` names the files. Both come
from a client, and the tree can change after the commit was accepted, so nothing is read by path:

* every directory from the root down is opened relative to its parent with ``O_NOFOLLOW``, so a
  symlinked checkpoint directory or parent (even one swapped in after the commit) is refused, and
  ``..``, absolute paths and ``/proc`` paths cannot be named;
* every file is ``lstat``-ed first (a FIFO or device node is refused without being opened), then
  opened ``O_NOFOLLOW|O_NONBLOCK``, ``fstat``-checked as the same regular file, and its blocking
  mode restored; a symlink, a FIFO, ``/dev/zero`` or a file whose size differs from the manifest
  is refused at once instead of blocking or being read forever;
* hard-linked files (``st_nlink > 1``) are refused: a link can point at a file outside the root
  that the client could not read itself, and the checkpoint engine never creates one;
* the manifest is read bounded (``MAX_MANIFEST_BYTES``) and its step must match the commit's.

:func:`staged` yields a private directory (0700, under the daemon's runtime directory, so that a
full state directory does not stop uploads) holding the
manifest bytes that were checked and, for each file, a link to ``/proc/self/fd/<n>`` of the
descriptor opened above; :class:`~spotguard.storage.durable.Durable` reads through those links, so
it sends exactly the inodes that were checked. Raises :class:`UnsafeCheckpoint`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import shutil
import stat
import uuid
from pathlib import Path
from typing import Iterator

from spotguard.storage._local import MANIFEST, ManifestError, validate_manifest
from spotguard.storage.fresh_node import DEFAULT_JOB

__all__ = ["UnsafeCheckpoint", "committed", "relative_to_root", "staged"]

MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_STEP = re.compile(r"^step-\d{10}$")
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class UnsafeCheckpoint(Exception):
    """The checkpoint cannot be uploaded as committed; retrying will not help."""


def _parts(rel: str, what: str) -> list[str]:
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise UnsafeCheckpoint(f"{what} {rel!r}: not a plain relative path")
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeCheckpoint(f"{what} {rel!r}: not UTF-8 (object stores and restores need it)") from None
    return parts


def _open_dirs(dir_fd: int, parts: list[str], fds: list[int]) -> int:
    """Open ``parts`` below ``dir_fd`` one directory at a time, never following a symlink."""
    for part in parts:
        try:
            dir_fd = os.open(part, _DIR, dir_fd=dir_fd)
        except OSError as exc:
            raise UnsafeCheckpoint(f"{part!r}: not a directory below the root ({exc.strerror})") from None
        fds.append(dir_fd)
    return dir_fd


def _open_regular(dir_fd: int, name: str, size: int | None) -> int:
    """A descriptor of the regular, singly linked file ``name`` (``size`` bytes when given)."""
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode):
            raise UnsafeCheckpoint(f"{name!r} is not a regular file (mode {stat.filemode(before.st_mode)})")
        fd = os.open(name, _FILE, dir_fd=dir_fd)
    except OSError as exc:
        raise UnsafeCheckpoint(f"{name!r}: cannot open ({exc.strerror})") from None
    st = os.fstat(fd)
    problem = ("changed while being opened" if (st.st_ino, st.st_dev) != (before.st_ino, before.st_dev)
               or not stat.S_ISREG(st.st_mode) else "is hard-linked" if st.st_nlink > 1
               else f"has {st.st_size} bytes, the manifest says {size}"
               if size is not None and st.st_size != size else None)
    if problem:
        os.close(fd)
        raise UnsafeCheckpoint(f"{name!r} {problem}")
    os.set_blocking(fd, True)
    return fd


def _read_manifest(dir_fd: int, where: str, fds: list[int]) -> tuple[bytes, dict]:
    fd = _open_regular(dir_fd, MANIFEST, None)
    fds.append(fd)
    if os.fstat(fd).st_size > MAX_MANIFEST_BYTES:
        raise UnsafeCheckpoint(f"{where}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    with os.fdopen(os.dup(fd), "rb") as src:
        data = src.read(MAX_MANIFEST_BYTES + 1)
    try:
        return data, validate_manifest(json.loads(data), where)
    except (ValueError, ManifestError) as exc:
        raise UnsafeCheckpoint(f"{where}: unusable manifest ({exc})") from None


def _fd_budget(files: int) -> None:
    """Raise the soft descriptor limit to the hard one; refuse a checkpoint that still does not fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if files + 256 > soft:
        raise UnsafeCheckpoint(f"{files} files exceed the daemon's descriptor limit ({soft})")


def relative_to_root(root: Path, path: Path) -> list[str]:
    """``path``'s components below ``root`` (both as the daemon resolved them); refused when not below."""
    for base in (os.path.realpath(root), os.path.abspath(root)):
        rel = os.path.relpath(os.path.abspath(path), base)
        if rel not in (".", "..") and not rel.startswith("../"):
            return _parts(rel, "checkpoint path")
    raise UnsafeCheckpoint(f"{path}: not a directory below the checkpoint root {root}")


@contextlib.contextmanager
def staged(root: Path, path: Path, step: int, staging: Path) -> Iterator[Path]:
    """Open checkpoint ``path`` (below ``root``, committed as ``step``) safely and yield a private
    directory that :meth:`Durable.upload` can read; everything is closed and removed afterwards."""
    if not os.path.isdir("/proc/self/fd"):
        raise OSError(errno.ENOENT, "/proc is not mounted: checkpoints cannot be read safely")
    fds: list[int] = []
    work = staging / uuid.uuid4().hex
    try:
        parts = relative_to_root(root, path)
        try:
            fds.append(os.open(os.path.realpath(root), _DIR & ~os.O_NOFOLLOW))  # the admin's choice
        except OSError as exc:
            raise UnsafeCheckpoint(f"checkpoint root {root}: {exc.strerror}") from None
        ckpt_fd = _open_dirs(fds[0], parts, fds)
        data, manifest = _read_manifest(ckpt_fd, str(path), fds)
        if manifest["step"] != step:
            raise UnsafeCheckpoint(f"{path}: manifest step {manifest['step']} is not the committed {step}")
        _fd_budget(len(manifest["files"]))
        out = work / Path(path).name
        out.mkdir(parents=True, mode=0o700)
        os.chmod(staging, 0o700)
        (out / MANIFEST).write_bytes(data)
        for rel, meta in manifest["files"].items():
            *dirs, name = _parts(rel, "manifest entry")
            fd = _open_regular(_open_dirs(ckpt_fd, dirs, fds), name, meta["size"])
            fds.append(fd)
            (out / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.symlink(f"/proc/self/fd/{fd}", out / rel)
        yield out
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)


def committed(root: Path, depth: int = 2) -> Iterator[tuple[str, int, Path]]:
    """``(job_id, step, path)`` of the checkpoint each ``latest`` pointer names in ``root`` and its
    subdirectories (``depth`` levels, symlinks not followed). Unreadable ones are skipped: the upload
    re-checks everything."""
    for where, dirs, names in os.walk(root, followlinks=False):
        if where != str(root) and len(Path(where).relative_to(root).parts) >= depth:
            dirs.clear()
        dirs[:] = [d for d in dirs if not d.startswith((".", "step-"))]
        if "latest" in names:
            with contextlib.suppress(OSError, UnsafeCheckpoint, ValueError, KeyError, TypeError):
                yield _pointed(Path(where))


def _pointed(where: Path) -> tuple[str, int, Path]:
    fd = os.open(where / "latest", _FILE)  # a FIFO answers EOF at once, never blocks
    try:
        name = os.read(fd, 64).decode().strip()
    finally:
        os.close(fd)
    if not _STEP.match(name):
        raise ValueError(name)
    fds: list[int] = []
    try:  # a hint only (job and step): staged() re-reads and checks everything
        fds.append(os.open(where, _DIR))
        _, manifest = _read_manifest(_open_dirs(fds[0], [name], fds), name, fds)
    finally:
        for fd in fds:
            os.close(fd)
    return str(manifest.get("job_id") or DEFAULT_JOB), int(manifest["step"]), where / name
