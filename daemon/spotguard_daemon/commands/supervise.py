"""Launching, signalling and stopping a training command and a private daemon, for the commands that
supervise a job (``spotguard drill``, ``spotguard run``).

A command runs in a session (and process group) of its own, so that a signal to the group reaches
the command and every child it did not move elsewhere, and never the supervisor itself. Launchers
such as ``torchrun`` may start workers in sessions of their own: :func:`~spotguard_daemon.proctree.descendants` finds them
in ``/proc``, never by name. A supervisor that is a subreaper (:func:`become_subreaper`) also finds
what a command left running after it exited (:func:`leftovers`). :func:`start_daemon` starts
``spotguard daemon`` and waits until it answers on its request socket. :class:`Registrar` registers a job's processes with the daemon for
its signal fallback, and :func:`reap` collects orphans for a supervisor that is PID 1.

Exceptions::

    LaunchError            a command or a daemon could not be started
      CommandNotFound      the command's executable does not exist (a shell's status 127)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Callable, Iterable

from spotguard_daemon.commands.common import daemon_status, held_interrupts, request
from spotguard_daemon.proctree import catches, descendants, stat_fields

__all__ = ["LaunchError", "CommandNotFound", "spawn", "start_daemon", "killpg",
           "signal_each", "stop", "reap",
           "Registrar", "STOP_S", "command_after_options", "become_subreaper", "leftovers"]

STOP_S = 10.0
"""Seconds a process gets after SIGTERM before SIGKILL when a supervisor stops it."""


class LaunchError(RuntimeError):
    """A command or a daemon could not be started."""


class CommandNotFound(LaunchError):
    """The command's executable does not exist."""


def command_after_options(command: tuple[str, ...], usage: str) -> list[str]:
    """The command given after a supervising CLI's options (``usage``: its synopsis); else
    ``click.UsageError``. Such a CLI leaves unknown options to the command, so click hands a
    mistyped option of its own over as the command's first word: that is refused, never run, and
    the closest option of the command is suggested (``--max-restart``: ``--max-restarts``)."""
    import difflib

    import click

    if command and command[0].startswith("-") and command[0] != "--":
        given = command[0].split("=", 1)[0]
        ctx = click.get_current_context(silent=True)
        known = [name for param in (ctx.command.params if ctx else [])
                 for name in getattr(param, "opts", []) + getattr(param, "secondary_opts", [])
                 if name.startswith("-")]
        close = difflib.get_close_matches(given, known, n=1)
        raise click.UsageError(f"no such option: {given}"
                               + (f" (did you mean {close[0]}?)" if close else ""))
    command = command[1:] if command and command[0] == "--" else command
    if not command:
        raise click.UsageError(f"no command given ({usage})")
    return list(command)


def spawn(argv: list[str], env: dict[str, str], out: IO | int | None = None,
          err: IO | int | None = None) -> subprocess.Popen:
    """Start ``argv`` in a new session; stdin closed unless ``out`` is None (then all three are
    inherited, as a supervisor that stays out of the way does)."""
    stdin = None if out is None else subprocess.DEVNULL
    try:
        return subprocess.Popen(argv, env=env, stdin=stdin, stdout=out, stderr=err,
                                start_new_session=True)
    except FileNotFoundError as exc:
        raise CommandNotFound(f"{argv[0]}: command not found") from exc
    except OSError as exc:
        raise LaunchError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc


def start_daemon(args: list[str], env: dict[str, str], log: IO | int | None, endpoint: str,
                 timeout: float = 30.0,
                 spawned: Callable[[subprocess.Popen], None] | None = None) -> subprocess.Popen:
    """``spotguard daemon ARGS`` in a session of its own, once it answers on ``endpoint``; the
    caller stops it (:func:`stop`). LaunchError when it exits or stays silent for ``timeout``; one
    interrupted while it waits (Ctrl-C, or SIGTERM raising as :func:`~.common.guarded` has it) is
    stopped before the interruption goes on, which is held while it starts
    (:func:`~.common.held_interrupts`): the caller never got it to stop. ``spawned`` is called
    with the process as soon as it exists, before the wait (the drill's reaper is told)."""
    proc, give_up = None, time.monotonic() + timeout
    try:
        with held_interrupts():
            proc = spawn([sys.executable, "-m", "spotguard_daemon", "daemon", *args], env, log,
                         None if log is None else subprocess.STDOUT)
        if spawned is not None:
            spawned(proc)
        while daemon_status(endpoint) is None:
            if proc.poll() is not None or time.monotonic() > give_up:
                stop(proc)
                raise LaunchError(f"the daemon did not start (status {proc.returncode})"
                                  + (f"; see {log.name}" if hasattr(log, "name") else ""))
            time.sleep(0.1)
    except BaseException:
        if proc is not None:
            stop(proc)
        raise
    return proc


def killpg(proc: subprocess.Popen, signum: int) -> None:
    """``signum`` to the process group ``proc`` leads; nothing when it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def signal_each(pids: set[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def stop(proc: subprocess.Popen, timeout: float = STOP_S) -> None:
    """SIGTERM to ``proc``'s group, SIGKILL after ``timeout``; returns once it was reaped."""
    if proc.poll() is None:
        killpg(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            killpg(proc, signal.SIGKILL)
            proc.wait()


def become_subreaper() -> bool:
    """Have this process's orphaned descendants reparented to it rather than to init (Linux's
    ``PR_SET_CHILD_SUBREAPER``), so that a supervisor still finds, ends and reaps what a command
    left running after it exited; False where the kernel refuses."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def leftovers(pgid: int | None, spare: Iterable[int] = ()) -> set[int]:
    """The live processes below this process (a subreaper's orphans included) and, unless ``pgid``
    is None, of process group ``pgid``, but ``spare`` and their descendants (a daemon the
    supervisor started): what a launch whose leader was ``pgid`` left running. Zombies are left
    out, and so are processes already exiting. A subreaper passes None: every leftover is below
    it, and the reaped leader's pgid could by then name an unrelated group."""
    spared = set(spare).union(*(descendants(pid) for pid in spare))
    found = descendants(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat") if pgid is not None else ():
        fields = stat_fields(int(stat.parent.name))
        if fields and fields[2] == str(pgid):
            found.add(int(stat.parent.name))
    return {pid for pid in found - spared - {os.getpid()} if (fields := stat_fields(pid)) is not None
            and fields[0] not in "ZX" and not int(fields[6]) & PF_EXITING}


PF_EXITING = 0x4
"""The kernel's flag (``/proc/<pid>/stat``'s 9th field) of a process inside its exit: not left
running, and already without its command line (a multiprocessing helper ending with the job)."""


def reap(known: list[subprocess.Popen]) -> None:
    """As PID 1: collect every exited child, orphans included; a ``known`` one keeps its status."""
    by_pid = {proc.pid: proc for proc in known}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in by_pid:
            by_pid[pid].returncode = os.waitstatus_to_exitcode(status)


class Registrar:
    """Registers with the daemon at ``endpoint`` the processes of a job that catch ``signum`` (the
    daemon's delivery signal), each once, so that its signal fallback reaches jobs that do not
    import spotguard. A process without a handler is left out: the signal would kill it."""

    def __init__(self, endpoint: str, signum: int) -> None:
        self.endpoint, self.signum = endpoint, signum
        self.done: set[int] = set()
        self.mine: set[int] = set()
        """The pids this registrar registered (not those that registered themselves)."""

    def scan(self, root: int) -> None:
        """Register the new catching processes of the tree under (and including) ``root``."""
        new = [pid for pid in sorted({root} | descendants(root))
               if pid not in self.done and catches(pid, self.signum)]
        # Every one is registered, clients of spotguard too: the daemon keeps the rank and job a
        # process registered itself with. (Skipping the pids in status would skip this container's
        # pid 1 when another container's pid 1 is registered: a pid names no process across them.)
        for pid in new:
            if pid not in self.done and not self._register(pid):
                return  # the daemon is away: the next scan tries again

    def report_safe(self) -> None:
        """The job stopped cleanly (status 75): tell the daemon its registered processes are safe,
        as a spotguard client does itself, so that a drill is withdrawn and Azure acknowledged
        early. The processes are forgotten: the next launch has new ones."""
        from spotguard.protocol import SafeRequest

        for pid in sorted(self.mine):
            request(self.endpoint, SafeRequest(pid=pid), 2.0, strict=False)
        self.mine.clear()

    def _register(self, pid: int) -> bool:
        from spotguard.protocol import RegisterRequest

        reply = request(self.endpoint, RegisterRequest(pid=pid), 2.0, strict=False)
        if reply is None:
            return False
        self.done.add(pid)
        if reply.ok:
            self.mine.add(pid)
        else:
            print(f"spotguard run: the daemon refused to register pid {pid} ({reply.error}); it "
                  "learns of notices only if it asks the daemon itself", file=sys.stderr)
        return True
