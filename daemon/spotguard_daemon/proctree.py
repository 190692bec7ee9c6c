"""Process trees and identity, read from ``/proc``: who a process's parent and descendants are,
which process a pid names now (its start time), who owns it, and whether it catches a signal.

A leaf below both halves of the package: the daemon's core checks with it who may register or be
signalled (:mod:`spotguard_daemon.core.peers`), and the commands that supervise a job find the
job's processes with it (:mod:`spotguard_daemon.commands.supervise`). It imports nothing of
spotguard's.

Exceptions: none; a process that is not visible reads as None, False or an empty set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

__all__ = ["catches", "descendants", "descends", "mp_helper", "owner_uid", "parent_of",
           "process_start_time", "stat_fields"]

MP_HELPERS = {"from multiprocessing.forkserver import main": "forkserver",
              "from multiprocessing.resource_tracker import main": "resource tracker"}
"""How the ``-c`` program of Python's multiprocessing helpers starts, and what each one is."""


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state, ppid, pgrp, ...); None
    when the process is not visible."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 2 else None


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _mp_program(pid: int) -> str | None:
    argv = _argv(pid)
    for flag, program in zip(argv, argv[1:]):
        if flag == "-c":
            return next((kind for start, kind in MP_HELPERS.items()
                         if program.lstrip().startswith(start)), None)
    return None


def mp_helper(pid: int) -> str | None:
    """``"forkserver"`` or ``"resource tracker"`` when ``pid`` is one of the helper processes that
    Python's multiprocessing starts for a process (a data loader's forkserver, the tracker of its
    shared memory), read from its ``/proc`` command line; else None. A worker the forkserver
    forked carries the server's command line but has the server as its parent: it is no helper."""
    kind = _mp_program(pid)
    if kind == "forkserver" and _mp_program(parent_of(pid) or 0) == "forkserver":
        return None
    return kind


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (0 for a namespace's first process); None when it is not
    visible."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields and fields[1].isdigit() else None


def descends(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is ``pid``'s parent, grandparent... (a walk up from ``pid``)."""
    for _ in range(256):
        pid = parent_of(pid) or 0
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc now."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        parent = parent_of(int(stat.parent.name))
        if parent is not None:
            parents[int(stat.parent.name)] = parent
    return parents


def descendants(root: int) -> set[int]:
    """The pids below ``root`` in the process tree now (empty where there is no /proc): read from
    each thread's ``children`` list, or, on a kernel without one, from every process's parent."""
    if Path(f"/proc/{root}/task/{root}/children").exists():
        return _walk(root, _children)
    tree: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        tree.setdefault(parent, []).append(pid)
    return _walk(root, lambda pid: tree.get(pid, []))


def _walk(root: int, children: Callable[[int], Iterable[int]]) -> set[int]:
    found, todo = set(), [root]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.update(int(word) for word in task.read_text().split())
        except (OSError, ValueError):
            continue
    return found


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` installed a handler for ``signum`` (``SigCgt`` in its status):
    only such a process may be sent a stop signal, which would otherwise kill it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when the pid is not visible."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def owner_uid(pid: int) -> int | None:
    """The uid that fully owns the process (real and effective uid equal), else None.

    None also when the pid is not visible. A setuid program run by a user (real uid the user's,
    effective uid root's) is owned by no one here, so nobody but root can register it.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                real, effective = (int(v) for v in line.split()[1:3])
                return real if real == effective else None
    except (OSError, ValueError):
        return None
    return None
