"""The prompt exit after a committed stop: status 75 in well under a second, not after torch's teardown.

Once :class:`~spotguard.run.Run` has committed the stop's checkpoint, told the daemon "safe" and
recorded the ``stop`` line, nothing the process still does matters to the job, but the interpreter's
own finalisation (clearing every module and collecting torch's object graph: seconds of CPU, more on
a loaded machine) runs before the status reaches the platform. RunPod's 5 s grace or a short
Kubernetes ``terminationGracePeriodSeconds`` then kills a process that had stopped cleanly, and the
scheduler sees a death by signal instead of 75.

The prompt exit keeps everything a user expects of ``sys.exit(75)`` and skips only that
finalisation. ``Run`` raises :func:`stop_exit`'s ``SystemExit(75)`` (a subclass):

* it propagates as usual: ``finally`` blocks and context managers run (bounded, as before, by the
  forced-exit watchdog at the notice's deadline minus its margin: status 76);
* only when it reaches the top level and ends the program (the interpreter reads its ``code`` with
  no Python frame left; a handler that catches it, pytest's or a user's ``except SystemExit``, keeps
  its own status and the full teardown), non-daemon threads are joined as usual, then the first
  ``atexit`` handler (registered at the stop, so it runs first) runs the others itself, newest first
  (logging's flush, wandb's, torch's, :func:`spotguard.data.stop_workers` for loader iterators still
  referenced), kills child processes still alive :data:`CHILD_GRACE` later, flushes every writable
  file object still open (what finalisation does for a file left open in a global: a scan of the
  objects, 0.1-0.4 s with torch loaded) and ends with ``os._exit(75)``. The ``atexit`` handlers
  get :data:`EXIT_GRACE` seconds, then the process exits 75 anyway (every thread's stack on stderr).

Skipped: finalizers (``__del__``) that only module teardown would run, and C++ static destructors
(a process group or CUDA context not destroyed explicitly is released by the kernel and the driver,
as after any kill). ``$SPOTGUARD_FAST_EXIT=0`` turns the prompt exit off.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import multiprocessing
import os
import sys
import time
from typing import Any

from spotguard._watchdog import Watchdog
from spotguard.exit_codes import EXIT_INTERRUPTED, EXIT_PREEMPTED

__all__ = ["ENV", "EXIT_GRACE", "enabled", "stop_exit", "interrupt", "interrupted"]

ENV = "SPOTGUARD_FAST_EXIT"
EXIT_GRACE = 10.0
"""Seconds the ``atexit`` handlers may take before the prompt exit happens anyway."""
CHILD_GRACE = 2.0
"""Seconds child processes still alive after the ``atexit`` handlers get before SIGKILL."""

_FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
_state: dict[str, Any] = {}


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class _StopExit(SystemExit):
    """``SystemExit(code)`` that notes when the interpreter's top level reads its ``code``: that
    read, with no Python frame calling, is what tells it ended the program (not caught)."""

    @property  # type: ignore[override]
    def code(self) -> Any:
        if sys._getframe().f_back is None:
            _state["top"] = True
        return SystemExit.code.__get__(self)  # type: ignore[attr-defined]


def interrupt(echo_s: float = 0.0) -> bool:
    """Note a SIGINT (Ctrl-C), from a signal handler; True when one came before, more than
    ``echo_s`` seconds earlier: the second aborts at once. (Under torchrun a terminal's Ctrl-C
    reaches each rank twice, from the terminal and from the agent passing it on: ``echo_s``.)"""
    now, first = time.monotonic(), _state.get("interrupted")
    if first is None:
        _state["interrupted"] = now
        return False
    return now - first > echo_s


def interrupted() -> bool:
    """Whether this process was sent SIGINT while a guard watched (its stop exits 130)."""
    return _state.get("interrupted") is not None


def stop_exit(code: int) -> SystemExit:
    """The ``SystemExit(code)`` to raise after a committed stop (see the module docstring); 75
    becomes 130 (:data:`~spotguard.exit_codes.EXIT_INTERRUPTED`) when the stop was a Ctrl-C."""
    if code == EXIT_PREEMPTED and interrupted():
        code = EXIT_INTERRUPTED
    if not enabled():
        return SystemExit(code)
    _state.update(code=code, top=False)
    atexit.unregister(_exit_now)
    atexit.register(_exit_now)
    return _StopExit(code)


def _exit_now() -> None:
    """The first ``atexit`` handler to run: when the stop ended the program, run the others,
    reap the children, flush and leave; else (it was caught) do nothing."""
    if not _state.get("top"):
        return
    atexit.unregister(_exit_now)
    code = _state["code"]
    Watchdog(code, f"atexit handlers after the committed stop took over {EXIT_GRACE:.0f} s").arm(
        time.monotonic() + EXIT_GRACE)
    atexit._run_exitfuncs()  # the other handlers, newest first, as the interpreter would
    _reap_children(CHILD_GRACE)
    _flush_files()
    os._exit(code)


def _reap_children(grace: float) -> None:
    """Join the ``multiprocessing`` children still alive, SIGKILL those that outlast ``grace``."""
    deadline = time.monotonic() + grace
    for child in multiprocessing.active_children():
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(1.0)


def _flush_files() -> None:
    """Flush stdout, stderr, logging and every writable file object still open, as teardown would."""
    logging.shutdown()
    for obj in [sys.stdout, sys.stderr, *(o for o in gc.get_objects() if type(o) in _FILES)]:
        try:
            if obj is not None and not obj.closed and obj.writable():
                obj.flush()
        except (OSError, ValueError):
            pass
