"""The forced-exit watchdog: a hung clean stop must not outlive the interruption's deadline.

After a terminating notice, the training loop is expected to reach a step boundary, save, and exit
on its own. A collective whose peer is already gone, a wedged data loader or a stuck file system can
keep it from ever getting there, holding the accelerator until the platform's hard kill and leaving
a launcher no way to tell "preempted" from "crashed". The watchdog is a daemon thread that, once
armed, calls ``os._exit(code)`` at the armed instant unless disarmed first. ``os._exit`` skips
``finally`` blocks and atexit handlers on purpose: those are what may be hung. Before exiting it
dumps every thread's stack to stderr (:func:`faulthandler.dump_traceback`, which writes to the file
descriptor without taking any Python lock), so the user sees where the process hung.

``before_exit``, when given, runs in the watchdog's thread just before the exit (errors ignored): it
must take no lock the main thread may hold; :class:`spotguard.run.Run` appends the run record's
``peer_lost`` line there (one ``os.write``), so that tools tell a lost peer from a crash.

``probe``, when given, is asked every ``probe_seconds`` while the watchdog is armed, in its thread,
and once more at the armed instant (``final=True``): a ``(code, reason)`` it returns ends the process
at once with that code and reason instead. :class:`spotguard.run.Run`'s progress watchdog probes for
a hang of this rank's own (:mod:`spotguard._stall`), so that a stuck loader worker or save is named,
and ends the rank early, instead of a lost peer being blamed at ``peer_timeout``. The probe must take
no lock either. ``fired`` holds the ``(code, reason)`` of the exit for ``before_exit``.

Every forced exit first runs the hooks registered with :func:`on_forced_exit` (errors ignored):
:mod:`spotguard.data` SIGKILLs its loader workers there, which ``os._exit`` would leave behind.

Arming again keeps the earlier instant (a later notice never postpones an earlier deadline).
:meth:`Watchdog.reset` moves the instant either way, quietly: the progress bound of a distributed
run (:class:`spotguard.run.Run`'s ``peer_timeout``) pushes it forward at every step boundary, so it
fires only when no boundary is reached for that long.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable

__all__ = ["Watchdog", "on_forced_exit", "run_exit_hooks"]

log = logging.getLogger(__name__)

Probe = Callable[[bool], "tuple[int, str] | None"]

_EXIT_HOOKS: list[Callable[[], object]] = []


def on_forced_exit(hook: Callable[[], object]) -> None:
    """Run ``hook`` just before any forced exit of this process (once, however often registered)."""
    if hook not in _EXIT_HOOKS:
        _EXIT_HOOKS.append(hook)


def run_exit_hooks() -> None:
    """Run the :func:`on_forced_exit` hooks; for other ``os._exit`` paths (a lost peer) too."""
    for hook in list(_EXIT_HOOKS):
        try:
            hook()
        except BaseException:  # noqa: BLE001 - nothing may keep the exit from happening
            pass


class Watchdog:
    """Calls ``os._exit(code)`` at the armed ``time.monotonic()`` instant unless disarmed."""

    def __init__(self, code: int, reason: str = "clean stop overran its deadline",
                 before_exit: Callable[[], object] | None = None, probe: Probe | None = None,
                 probe_seconds: float = 2.0) -> None:
        self._code, self._reason, self._before_exit = code, reason, before_exit
        self._probe, self._probe_seconds = probe, probe_seconds
        self.fired: tuple[int, str] | None = None
        """The ``(code, reason)`` of the forced exit, once it is happening."""
        self._cond = threading.Condition()
        self._at: float | None = None
        self._thread: threading.Thread | None = None

    @property
    def armed_at(self) -> float | None:
        """The monotonic instant of the forced exit, or None while disarmed."""
        return self._at

    def arm(self, at: float) -> None:
        """Force the exit at monotonic time ``at`` (or keep an earlier instant already armed)."""
        with self._cond:
            if self._at is not None and self._at <= at:
                return
            self._at = at
            if self._thread is None:
                self._start()
            self._cond.notify_all()
        log.info("forced exit armed in %.1f s", at - time.monotonic())

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spotguard-watchdog", daemon=True)
        self._thread.start()

    def reset(self, at: float) -> None:
        """Force the exit at ``at`` instead, later or earlier, without logging (called per step).

        A later instant wakes nobody: the thread finds it when its current wait ends, so a step
        costs a lock, not a thread switch."""
        with self._cond:
            previous, self._at = self._at, at
            if self._thread is None:
                self._start()
            if previous is None or at < previous:
                self._cond.notify_all()

    def disarm(self) -> None:
        with self._cond:
            if self._at is not None:
                log.info("forced exit disarmed")
            self._at = None
            self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._at is None:
                    self._cond.wait()
                    continue
                left = self._at - time.monotonic()
                verdict = self._ask_probe(final=left <= 0)
                if verdict is not None or left <= 0:
                    break
                self._cond.wait(left if self._probe is None else min(left, self._probe_seconds))
        # No logging here: a hung main thread may hold a handler's or sys.stderr's lock.
        code, reason = self.fired = verdict or (self._code, self._reason)
        try:
            os.write(2, f"spotguard: {reason}; forced exit {code}\n".encode())
            faulthandler.dump_traceback(file=2, all_threads=True)
            if self._before_exit is not None:
                self._before_exit()
        except BaseException:  # noqa: BLE001 - nothing may keep the exit from happening
            pass
        finally:
            run_exit_hooks()
            os._exit(code)

    def _ask_probe(self, final: bool) -> tuple[int, str] | None:
        if self._probe is None:
            return None
        try:
            return self._probe(final)
        except Exception:  # noqa: BLE001 - a failing probe must not disable the watchdog
            return None
