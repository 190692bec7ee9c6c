"""The private directory of a ``spotguard run`` supervisor, and the sweep of those dead ones left.

Each supervisor keeps its launches' record (``record.jsonl``, see :mod:`spotguard._record`) in a
directory of its own, ``<tmp>/spotguard-run-<pid>-<random>`` (mode 0700, ``tempfile.mkdtemp``), and
removes it when it ends. A supervisor killed by SIGKILL (the OOM killer, a node agent) cannot, so
every start removes those left by dead supervisors. It holds an ``flock`` on its directory while it
lives, which the kernel drops when the process dies however it dies, and which works across pid
namespaces that share one ``/tmp`` (where a pid alone would say "dead" of a live supervisor).

A directory is removed only when all of these hold; anything else is left as it is, silently:

* its name is ``spotguard-run-<pid>-<suffix>`` (older releases' directories, without the pid and
  the lock, are never touched: their supervisor may be alive);
* it is a directory, not a link, owned by this user and private (0700);
* no process holds its lock, and no process runs with its pid;
* it holds nothing but a ``record.jsonl`` that is a regular file (or nothing at all).

``/tmp``'s sticky bit keeps other users from renaming or replacing a directory this user owns, so
what was checked is what is removed. Exceptions: none escape :func:`sweep`.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["PREFIX", "Private", "sweep"]

PREFIX = "spotguard-run-"
RECORD = "record.jsonl"


class Private:
    """This supervisor's directory, locked while it lives; :meth:`close` removes it."""

    def __init__(self, base: Path | None = None) -> None:
        sweep(base)
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self) -> None:
        try:
            for name in os.listdir(self._fd):
                os.unlink(name, dir_fd=self._fd)
            os.rmdir(self.path)
        except OSError:
            pass  # a sweep at the next start finds what is left, once the lock is gone
        finally:
            os.close(self._fd)


def sweep(base: Path | None = None) -> int:
    """Remove the directories of dead supervisors in ``base`` (the temp directory); how many."""
    base = Path(base or tempfile.gettempdir())
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    return sum(_remove(base, name) for name in names if (pid := _pid(name)) is not None and not _running(pid))


PID_MAX = 1 << 22
"""Linux's largest pid (``/proc/sys/kernel/pid_max`` can be no higher): a name with a larger
number is no supervisor's (and ``os.kill`` would raise OverflowError on it)."""


def _pid(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    pid, dash, suffix = name[len(PREFIX):].partition("-")
    return int(pid) if pid.isdigit() and len(pid) <= 7 and 0 < int(pid) <= PID_MAX and dash and suffix else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process has the pid
        return True
    return True


def _remove(base: Path, name: str) -> bool:
    try:
        fd = os.open(base / name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # a link, not a directory, or gone
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its supervisor lives (perhaps in another pid namespace)
            return False
        inside = os.listdir(fd)
        if any(n != RECORD for n in inside):
            return False
        for n in inside:
            if not stat.S_ISREG(os.stat(n, dir_fd=fd, follow_symlinks=False).st_mode):
                return False
            os.unlink(n, dir_fd=fd)
        os.rmdir(base / name)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
