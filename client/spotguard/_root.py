"""A checkpoint root at a run's start: writable, and held by one launch only.

* :func:`probe` writes and removes a small file under the root, so a read-only file system or a
  directory this user cannot write is refused at start, with one line naming the path and the
  error, instead of at the first save (hours later with the default cadence).
* :func:`hold` takes an exclusive lock (``fcntl``'s, as ``flock`` a kernel lock, but one that
  forked children such as data loader workers do not inherit, and that works on NFS) on
  ``<root>/.spotguard.lock``. A second launch on the same root (another ``python train.py``,
  which would train alongside the first and interleave its commits) is refused at start, with one
  line naming the pid and host holding the root. The kernel releases the lock when the holder's
  process ends, however it ends (SIGKILL too), so a lock left by a dead process never blocks: ``spotguard run`` relaunches, a requeued job and a
  restarted container pass. One process per root takes it, the rank that commits the root's
  checkpoints (rank 0 for a shared root, each node's leader for node-local roots), so the ranks
  of one job pass; a process that already holds a root may open it again (a second ``Run`` on it
  in the same process). The lock file stays in the root (its content only names the holder).

Both refusals are :class:`StartRefused`, a ``SystemExit`` whose message Python prints as one line
on stderr, exit status 1 (not 75: ``spotguard run`` does not relaunch it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import threading
import time
from pathlib import Path

__all__ = ["LOCK_NAME", "StartRefused", "alive", "hold", "probe", "release"]

LOCK_NAME = ".spotguard.lock"

_held: dict[tuple[int, int], list[int]] = {}
"""(device, inode) of a lock file this process holds -> [fd, users]."""
_held_lock = threading.Lock()


class StartRefused(SystemExit):
    """A run refused at its start; the message is the one line printed (exit status 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"spotguard: {message}")


def probe(root: Path) -> None:
    """Create, write, fsync and remove a file under ``root``; :class:`StartRefused` when it fails."""
    path = root / f".spotguard-probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"spotguard\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(path)
    except OSError as exc:
        raise StartRefused(unwritable(root, exc)) from None


def unwritable(root: Path, exc: OSError) -> str:
    """The refusal's line for a root that cannot be written."""
    return (f"cannot write the checkpoint root {root}: {exc.strerror or exc} (errno "
            f"{errno.errorcode.get(exc.errno or 0, exc.errno)}); give the run a directory it can write")


def hold(root: Path, job_id: str) -> tuple[int, int]:
    """Take the root's lock for this process (kept until :func:`release` or the process ends);
    :class:`StartRefused` naming the holder when another process holds it. Returns the key to
    release it with."""
    path = root / LOCK_NAME
    with _held_lock:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            pass
        else:
            if (st.st_dev, st.st_ino) in _held:  # held here already (another Run on the same root):
                _held[st.st_dev, st.st_ino][1] += 1  # no second descriptor, whose close would unlock it
                return st.st_dev, st.st_ino
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StartRefused(unwritable(root, exc)) from None
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StartRefused(busy(root, holder)) from None
            raise StartRefused(f"cannot lock the checkpoint root {root}: {exc.strerror or exc}") from None
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {job_id or '-'} {started}\n".encode(), 0)
        _held[key] = [fd, 1]
    return key


def release(key: tuple[int, int] | None) -> None:
    """Give back one use of the lock :func:`hold` returned ``key`` for; the last one unlocks it."""
    with _held_lock:
        entry = _held.get(key) if key is not None else None
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            os.close(entry[0])  # closing the only descriptor releases the lock


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def busy(root: Path, holder: str) -> str:
    """The refusal's line for a root another launch holds."""
    parts = holder.split(" ", 3)
    if len(parts) < 4 or not parts[0].isdigit():
        who = "another process"
    else:
        pid, host, job, since = int(parts[0]), parts[1], parts[2], parts[3]
        who = f"pid {pid} on host {host} (job {job}, since {since})"
    return (f"the checkpoint root {root} is in use by {who}: two launches on one root would "
            "interleave their checkpoints. Wait for that run to end (or stop it), or give this "
            "launch another checkpoint root")


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one of another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
