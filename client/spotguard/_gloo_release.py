"""Wait, after a collective, until gloo's worker thread has let go of the tensors.

A gloo worker thread destroys each finished work object, and with it its references to the
work's tensors; dropping such a reference decrefs the tensor's Python object, which takes the
GIL. ``work.wait()`` returns before that. If the interpreter is finalising at that instant (a
refusal or a stop raised right after the collective, then the process exits), CPython ends the
worker thread with ``pthread_exit`` inside C++ code and the process aborts: "terminate called
without an active exception", SIGABRT instead of a clean exit code. So every collective of ours
waits here, a few microseconds in practice, until only Python holds its tensors again.

Other code's collectives (the Hugging Face ``Trainer``'s last ``all_gather``, in ``store_flos``;
any job's own) have no such wait. So the first collective of ours also registers :func:`_settle`
at exit: before the interpreter finalises, it sleeps (the GIL free) until no other thread of the
process is runnable at two looks 5 ms apart, at most 0.5 s. A 2-rank gloo job that ends right
after an ``all_gather`` aborted so in 12 of 20 launches here, and the HF job in about 1 of 10.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

_BOUND = 2.0
"""Seconds to wait at most (a worker stalled that long is someone else's problem to report)."""
SETTLE_BOUND = 0.5
"""Seconds the exit waits at most for the process's other threads to go idle (:func:`_settle`)."""
_settling = False


def released(*tensors: Any) -> None:
    """Return once nothing but their Python objects references the CPU ones of ``tensors`` (or
    after 2 s). Drop the work object first: it references them too."""
    cpu = [t for t in tensors if t.device.type == "cpu"]  # gloo's; NCCL's watchdog keeps its own
    if cpu:
        settle_at_exit()
    deadline = time.monotonic() + _BOUND
    while any(t._use_count() > 1 for t in cpu) and time.monotonic() < deadline:
        time.sleep(0.0001)  # releases the GIL the worker's decref needs


def settle_at_exit() -> None:
    """Register :func:`_settle` to run at the interpreter's exit (once per process)."""
    global _settling
    if not _settling:
        _settling = True
        atexit.register(_settle)


def _settle(bound: float = SETTLE_BOUND) -> None:
    """Sleep, the GIL free, until no other thread is runnable at two looks in a row (or ``bound``
    s): a gloo worker about to drop a finished collective's tensors does it now, while it still
    may take the GIL (atexit handlers run before the interpreter starts finalising)."""
    me, quiet = str(threading.get_native_id()), 0
    deadline = time.monotonic() + bound
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
        quiet = 0 if _others_runnable(me) else quiet + 1


def _others_runnable(me: str) -> bool:
    """Whether a thread of this process other than ``me`` is running or waiting for a CPU (Linux's
    ``/proc``; elsewhere: False, and the exit waits 10 ms)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                fields = stat.read()
        except OSError:  # the thread ended meanwhile
            continue
        state = fields.rfind(b")") + 2  # after "pid (comm) "; comm may hold spaces and parentheses
        if fields[state:state + 1] == b"R":
            return True
    return False
