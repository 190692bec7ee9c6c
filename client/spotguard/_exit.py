"""The prompt exit after a committed stop: status 75 in well under a second, not after torch's teardown.

Once :class:`~spotguard.run.Run` has committed the stop's checkpoint, told the daemon "safe" and
recorded the ``stop`` line, nothing the process still does matters to the job, but the interpreter's
own finalisation (clearing every module and collecting torch's object graph: seconds of CPU, more on
a loaded machine) runs before the status reaches the platform. RunPod's 5 s grace or a short
Kubernetes ``terminationGracePeriodSeconds`` then kills a process that had stopped cleanly, and the
scheduler sees a death by signal instead of 75.

:func:`arm` (called by ``Run`` just before it raises ``SystemExit(75)``) keeps everything a user
expects of ``sys.exit`` and skips only that finalisation:

* the ``SystemExit`` propagates as usual: ``finally`` blocks and context managers run, non-daemon
  threads are joined, and every ``atexit`` handler runs (logging's flush, wandb's, torch's);
* then, first thing at interpreter exit, spotguard runs the other ``atexit`` handlers itself (among
  them :func:`spotguard.data.stop_workers`, for loader iterators still referenced), kills child
  processes still alive after :data:`CHILD_GRACE`, flushes every writable file object still open
  (what finalisation would have done for a file left open in a global: a scan of the objects,
  ~0.1-0.4 s with torch loaded) and ends with ``os._exit(75)``.

What is skipped: object finalizers (``__del__``) that would only run during module teardown, and
C++ static destructors (a process group or CUDA context not destroyed explicitly is released by the
kernel and the driver, as after any kill). A program that catches the ``SystemExit`` and then fails
with another exception keeps its own status (the fast path stands down when ``sys.excepthook``
reports an uncaught exception); one that catches it and exits with another status still exits 75.
The teardown is bounded: a ``finally`` block or ``atexit`` handler still busy :data:`EXIT_GRACE`
seconds after the stop ends the process with 75 (and every thread's stack on stderr), as well as
the forced-exit watchdog's earlier deadline (76). ``$SPOTGUARD_FAST_EXIT=0`` turns all this off.
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

__all__ = ["ENV", "EXIT_GRACE", "arm", "enabled"]

ENV = "SPOTGUARD_FAST_EXIT"
EXIT_GRACE = 30.0
"""Seconds after the committed stop that ``finally`` blocks and ``atexit`` handlers may take."""
CHILD_GRACE = 2.0
"""Seconds child processes still alive after the ``atexit`` handlers get before SIGKILL."""

_FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
_armed: dict[str, Any] = {}


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def arm(code: int, grace: float = EXIT_GRACE) -> None:
    """Make the coming interpreter exit a prompt ``os._exit(code)`` (see the module docstring)."""
    if not enabled() or _armed:
        return
    watchdog = Watchdog(code, f"teardown after the committed stop took over {grace:.0f} s")
    watchdog.arm(time.monotonic() + grace)
    _armed.update(code=code, failed=False, watchdog=watchdog, excepthook=sys.excepthook)
    sys.excepthook = _excepthook
    atexit.register(_exit_now)


def _excepthook(*exc_info: Any) -> None:
    """An exception ended the program after the stop: its status (1) stands, not 75."""
    _armed["failed"] = True
    _armed["watchdog"].disarm()
    _armed["excepthook"](*exc_info)


def _exit_now() -> None:
    """The first ``atexit`` handler to run (registered last): do the rest, then leave."""
    atexit.unregister(_exit_now)
    if _armed.get("failed"):
        return
    atexit._run_exitfuncs()  # the other handlers, newest first, as the interpreter would
    _reap_children(CHILD_GRACE)
    _flush_files()
    os._exit(_armed["code"])


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
