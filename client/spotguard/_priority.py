"""Per-thread CPU priority for background work (checkpoint writers, the daemon's uploads).

Kept out of :mod:`spotguard.checkpoint` so that the daemon can lower its upload threads' priority
without importing torch. On Linux niceness is a property of each thread, and a thread inherits the
niceness of the thread that creates it: lowering a worker's priority before it starts a thread pool
lowers the pool's threads (and any the SDKs start from them) too.
"""

from __future__ import annotations

import os
import threading

__all__ = ["lower_priority"]


def lower_priority(nice: int | None) -> None:
    """Renice the calling thread (Linux: per thread) so background work yields to training.

    ``None`` or ``0`` leaves the priority alone; failures (another OS, a sandbox) are ignored: the
    work still runs, only at normal priority."""
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass
