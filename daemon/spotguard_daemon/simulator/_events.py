"""Scheduled interruption events and the one timer thread that flips them on time.

A :class:`SimEvent` is what the control API schedules: it is *pending* until its flip time, then
*active* (the platform's endpoints show it), and may end *cancelled*, *started* (Azure, after an
acknowledgement or at its deadline) or *done*. The flip is done by :class:`Timers`, a single thread
that waits on the simulator's shared condition, so a flip happens at its time whether or not a
request arrives, and every waiter (GCP long-polls, hanging faults) wakes the moment it happens.

``flipped_at`` is ``time.time()`` taken under the lock at the flip, so benchmarks can measure
notice latency against it.

Exceptions::

    ControlError             a control request that names an unknown kind, event or fault mode
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ControlError", "SimEvent", "Timers"]

logger = logging.getLogger(__name__)


class ControlError(ValueError):
    """A control request the simulator cannot carry out (the control API answers 400)."""


@dataclass
class SimEvent:
    """One scheduled event; times are epoch seconds (``time.time()``)."""

    id: str
    kind: str
    flip_at: float
    deadline: float
    resources: list[str] = field(default_factory=list)
    event_type: str | None = None
    duration: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    state: str = "pending"
    created_at: float = field(default_factory=time.time)
    flipped_at: float | None = None
    ended_at: float | None = None

    @property
    def active(self) -> bool:
        """True while the platform's endpoints show the event (active or started)."""
        return self.state in ("active", "started")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "kind": self.kind, "state": self.state,
            "created_at": self.created_at, "flip_at": self.flip_at,
            "flipped_at": self.flipped_at, "deadline": self.deadline,
            "ended_at": self.ended_at, "resources": list(self.resources),
            "event_type": self.event_type, "duration": self.duration, **self.extra,
        }


class Timers:
    """Run callbacks at wall-clock times on one daemon thread, holding the shared condition.

    Callbacks run with the condition's lock held and the condition is notified after each one, so a
    callback only changes state and every waiter re-checks its predicate. A callback that no longer
    applies (its event was cancelled) must check that itself and return; nothing is ever removed
    from the heap, which keeps cancellation trivially race-free.
    """

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="spotguard-sim-timers", daemon=True)
        self._thread.start()

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at epoch time ``when`` (at once if it has passed). Lock held by caller."""
        heapq.heappush(self._heap, (when, next(self._seq), callback))
        self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.time()
                if wait > 0:
                    self._cond.wait(timeout=wait)
                    continue
                _, _, callback = heapq.heappop(self._heap)
                self._fire(callback)

    def _fire(self, callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:  # a broken callback must not stop every later flip
            logger.exception("simulator timer callback failed")
        self._cond.notify_all()
