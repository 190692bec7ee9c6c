"""Wait, after a collective, until gloo's worker thread has let go of the tensors.

A gloo worker thread destroys each finished work object, and with it its references to the
work's tensors; dropping such a reference decrefs the tensor's Python object, which takes the
GIL. ``work.wait()`` returns before that. If the interpreter is finalising at that instant (a
refusal or a stop raised right after the collective, then the process exits), CPython ends the
worker thread with ``pthread_exit`` inside C++ code and the process aborts: "terminate called
without an active exception", SIGABRT instead of a clean exit code. So every collective of ours
waits here, a few microseconds in practice, until only Python holds its tensors again.
"""

from __future__ import annotations

import time
from typing import Any

_BOUND = 2.0
"""Seconds to wait at most (a worker stalled that long is someone else's problem to report)."""


def released(*tensors: Any) -> None:
    """Return once nothing but their Python objects references the CPU ones of ``tensors`` (or
    after 2 s). Drop the work object first: it references them too."""
    cpu = [t for t in tensors if t.device.type == "cpu"]  # gloo's; NCCL's watchdog keeps its own
    deadline = time.monotonic() + _BOUND
    while any(t._use_count() > 1 for t in cpu) and time.monotonic() < deadline:
        time.sleep(0.0001)  # releases the GIL the worker's decref needs
