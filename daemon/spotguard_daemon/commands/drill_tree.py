"""The processes of one ``spotguard drill`` launch, known by identity, and the files the drill writes.

A launcher such as ``torchrun`` starts its workers in sessions of their own, and they outlive a
launcher killed with SIGKILL, so the drill notes every descendant of a launch as it appears and
signals them at a preemption and at the launch's end. A pid is only a name, reused once its process
is gone: each is remembered with its start time (``/proc/<pid>/stat``) and signalled only while
the process under that pid has the same start time and belongs to this user, as the daemon checks
its clients (:mod:`spotguard_daemon.core.peers`). A pid reused by an unrelated process is never
signalled.

The report directory must not let another user plant or swap files in it: :func:`private_dir`
refuses one that someone else owns or can write, and the drill's files there are created with
``O_EXCL | O_NOFOLLOW`` (:func:`new_file`) or written to a private temporary file and renamed
(:func:`write_private`).

Exceptions: :func:`private_dir` raises ``ValueError`` with the reason.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO

from spotguard._record import untrusted
from spotguard_daemon.proctree import descendants, descends, owner_uid, process_start_time

__all__ = ["Tree", "private_dir", "new_file", "write_private"]


class Tree:
    """The verified descendants of a launch: pid -> start time."""

    def __init__(self) -> None:
        self.known: dict[int, int] = {}

    def note(self, root: int) -> dict[int, int]:
        """Remember the processes below ``root`` not seen yet, each with its identity, read and
        then checked to still descend from ``root`` (the pid was not reused in between); those
        new ones, pid -> start time."""
        new = {}
        for pid in descendants(root) - self.known.keys():
            start = process_start_time(pid)
            if start is not None and owner_uid(pid) == os.geteuid() and descends(pid, root):
                self.known[pid] = new[pid] = start
        return new

    def is_same(self, pid: int) -> bool:
        """Whether ``pid`` still names the process noted: same start time, same owner (this user)."""
        return (pid in self.known and process_start_time(pid) == self.known[pid]
                and owner_uid(pid) == os.geteuid())

    def signal(self, signum: int, group: bool = False) -> list[int]:
        """``signum`` to every noted process that is still the one noted (``group``: to the
        process group each one leads); the others (gone, or their pid reused) are forgotten. The
        pids signalled."""
        sent = []
        for pid in list(self.known):
            if not self.is_same(pid):
                del self.known[pid]
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                (os.killpg if group else os.kill)(pid, signum)
                sent.append(pid)
        return sent

    def clear(self) -> None:
        self.known.clear()


def private_dir(path: Path) -> Path:
    """Create ``path`` (0700) or accept an existing empty directory of this user that no one else
    can write; ValueError saying why otherwise. Checked after the creation, on the directory itself
    (never through a link), so a directory another user put there first is refused too."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    why = untrusted(os.lstat(path), directory=True)
    if why is not None:
        raise ValueError(f"{path} {why}; its owner or others could plant or swap files in it: use "
                         "a directory of your own that no one else can write")
    if any(path.iterdir()):
        raise ValueError(f"{path} is not empty")
    return path


def new_file(path: Path) -> IO[str]:
    """A new file opened for writing (0600); never an existing file, never through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "w")


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a private temporary file beside ``path`` and rename it over ``path``:
    whatever ``path`` was (a planted link included) is replaced, never written through."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
