"""The drill's reaper: a small process that stops what a ``spotguard drill`` left running, and
removes its temporary directory, when the drill dies without its own clean-up (a SIGKILL, the OOM
killer), which no handler of the drill sees.

The drill starts it first (:class:`Reaper`, with :mod:`subprocess`, never a bare ``fork``), in a
session of its own, so that no signal meant for the job or the terminal's group reaches it. Its
stdin is the read end of a pipe whose write end only the drill holds: ``os.pipe`` makes both ends
close-on-exec and ``subprocess`` closes every other descriptor in what it starts, so neither the
launched jobs nor the daemons hold a copy and the end of the drill is the end of the pipe. Over it
the drill says, a line each::

    launch PID START   a launch's process group (its leader's pid and start time) to stop
    daemon PID START   a private daemon's group: it stops by itself (--parent-pid), killed if not
    ended PID          that group was stopped by the drill
    seen PID START     a process seen below a launch (a worker in a session of its own)
    cleared            the processes seen were killed by the drill: forget them
    bye                the drill closed: exit at once, stopping nothing

At the end of the pipe without ``bye`` (or once its parent is no longer the drill, should a copy
of the write end have leaked), it stops what is still listed as the drill's ``close()`` would:
SIGTERM to each launch's group, SIGKILL to each group still there after ``STOP_S``, then SIGKILL to
every process seen below them (the descendants of a live leader are noted once more first), and
removes the temporary directory. Every pid is checked to still be the process named (its start
time in ``/proc`` and its owner, :class:`~spotguard_daemon.commands.drill_tree.Tree`) before each
signal: a pid reused by another process is never signalled. It lives as long as the drill, plus
``STOP_S`` and a moment, and never longer.

A line the drill could not write (the reaper gone or stuck) is dropped: the drill goes on, and its
own ``close()`` still stops everything when it runs.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from spotguard_daemon.commands.drill_tree import Tree
from spotguard_daemon.commands.supervise import leftovers
from spotguard_daemon.proctree import process_start_time

__all__ = ["Reaper"]

POLL_S = 0.1
BYE_S = 5.0
"""Seconds the drill waits for its reaper to exit after ``bye`` before it kills it."""


class Reaper:
    """The drill's side: starts the reaper of ``temp`` and tells it what runs."""

    def __init__(self, temp: Path, stop_s: float) -> None:
        read, self.fd = os.pipe()  # both ends close-on-exec (PEP 446)
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", __name__, str(temp), str(os.getpid()), repr(stop_s)],
                stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except BaseException:
            os.close(self.fd)
            raise
        finally:
            os.close(read)
        os.set_blocking(self.fd, False)  # a stuck reaper never blocks the drill

    def _say(self, *words: object) -> None:
        with contextlib.suppress(OSError):  # a line under PIPE_BUF is written whole or not at all
            os.write(self.fd, (" ".join(map(str, words)) + "\n").encode())

    def launch(self, pid: int, daemon: bool = False) -> None:
        """The group ``pid`` leads (the drill's child, not yet reaped) is to be stopped."""
        start = process_start_time(pid)
        if start is not None:
            self._say("daemon" if daemon else "launch", pid, start)

    def ended(self, pid: int) -> None:
        self._say("ended", pid)

    def seen(self, known: dict[int, int]) -> None:
        for pid, start in known.items():
            self._say("seen", pid, start)

    def cleared(self) -> None:
        self._say("cleared")

    def close(self) -> None:
        """``bye``: the reaper exits, stopping nothing; reaped here (killed after ``BYE_S``)."""
        if self.proc is None:
            return
        self._say("bye")
        fd, self.fd = self.fd, -1  # a later line fails (EBADF), never lands in a reused descriptor
        os.close(fd)
        try:
            self.proc.wait(BYE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Listed:
    """The reaper's side: what the drill said still runs."""

    def __init__(self) -> None:
        self.launches, self.daemons, self.seen = Tree(), Tree(), Tree()

    def take(self, line: bytes) -> bool:
        """Apply one line; False at ``bye``. A malformed line is passed over."""
        words = line.decode(errors="replace").split()
        with contextlib.suppress(ValueError, IndexError):
            if words == ["bye"]:
                return False
            if words[0] in ("launch", "daemon", "seen"):
                tree = {"launch": self.launches, "daemon": self.daemons, "seen": self.seen}[words[0]]
                tree.known[int(words[1])] = int(words[2])
            elif words[0] == "ended":
                self.launches.known.pop(int(words[1]), None)
                self.daemons.known.pop(int(words[1]), None)
            elif words == ["cleared"]:
                self.seen.clear()
        return True

    def stop(self, stop_s: float) -> None:
        """Stop what is listed, as the drill's ``close()`` does (see the module's docstring)."""
        for tree in (self.launches, self.daemons):
            for leader in [pid for pid in tree.known if tree.is_same(pid)]:
                self.seen.note(leader)
        self.launches.signal(signal.SIGTERM, group=True)
        leaders = set(self.launches.known) | set(self.daemons.known)
        give_up = time.monotonic() + stop_s
        while time.monotonic() < give_up and any(leftovers(leader) for leader in leaders):
            time.sleep(POLL_S)
        self.launches.signal(signal.SIGKILL, group=True)
        self.daemons.signal(signal.SIGKILL, group=True)
        self.seen.signal(signal.SIGKILL)


def main(argv: list[str]) -> int:
    """``python -m spotguard_daemon.commands.drill_reaper TEMP DRILL_PID STOP_S``, stdin the pipe."""
    temp, parent, stop_s = Path(argv[0]), int(argv[1]), float(argv[2])
    listed, pending = Listed(), b""
    while True:
        if not select.select([0], [], [], 1.0)[0]:
            if os.getppid() != parent:
                break  # the drill is gone, though a copy of the pipe's end is not
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break  # the drill is gone: its end of the pipe closed with it
        *lines, pending = (pending + chunk).split(b"\n")
        if not all(listed.take(line) for line in lines):
            return 0
    listed.stop(stop_s)
    shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
