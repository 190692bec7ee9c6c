"""Injected faults: the next N metadata requests, or those of the next S seconds, misbehave.

Modes: ``500``, ``503``, ``429``, ``401`` (that status), ``slow`` (answer normally after ``delay``
seconds), ``hang`` (never answer; the connection is dropped when the fault is cleared, expires, the
server stops, or after :data:`HANG_MAX_SECONDS`), ``garbage`` (200 with a body no client can parse),
``truncated`` (headers promise more body than is sent, then the connection closes) and ``reset``
(the connection is closed with a TCP RST before any answer). Faults apply to metadata requests only,
never to the control API, and the oldest live fault wins.

Exceptions::

    ControlError             (from ._events) an unknown mode or a bad count/seconds/delay
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ._events import ControlError

__all__ = ["Fault", "FaultBook", "MODES", "HANG_MAX_SECONDS"]

MODES = ("500", "503", "429", "401", "slow", "hang", "garbage", "truncated", "reset")
HANG_MAX_SECONDS = 60.0
_DEFAULT_DELAY = 1.0


@dataclass
class Fault:
    id: str
    mode: str
    remaining: int | None
    until: float | None
    delay: float
    created_at: float = field(default_factory=time.time)
    hits: int = 0
    cleared: bool = False

    def live(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return (not self.cleared and (self.remaining is None or self.remaining > 0)
                and (self.until is None or now < self.until))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "mode": self.mode, "remaining": self.remaining, "until": self.until,
                "delay": self.delay, "created_at": self.created_at, "hits": self.hits,
                "live": self.live()}


class FaultBook:
    """The faults in force. Shares the simulator's condition so a hang wakes when one is cleared."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._faults: list[Fault] = []
        self._ids = itertools.count(1)
        self._clears = 0

    def add(self, mode: str, count: int | None = None, seconds: float | None = None,
            delay: float | None = None) -> Fault:
        """Apply ``mode`` to the next ``count`` requests and/or for ``seconds`` (neither: until cleared)."""
        mode = str(mode)
        if mode not in MODES:
            raise ControlError(f"unknown fault mode {mode!r}; one of {list(MODES)}")
        if count is not None and (isinstance(count, bool) or int(count) < 1):
            raise ControlError("count must be a positive integer or null")
        if seconds is not None and not 0 < float(seconds) <= 24 * 3600:
            raise ControlError("seconds must be positive (at most a day) or null")
        if delay is not None and not 0 <= float(delay) <= HANG_MAX_SECONDS:
            raise ControlError(f"delay must be between 0 and {HANG_MAX_SECONDS:.0f} seconds")
        with self._cond:
            fault = Fault(f"fault-{next(self._ids)}", mode, None if count is None else int(count),
                          None if seconds is None else time.time() + float(seconds),
                          _DEFAULT_DELAY if delay is None else float(delay))
            self._faults.append(fault)
            return fault

    def take(self) -> Fault | None:
        """The fault that applies to the request arriving now (consuming one of its count)."""
        with self._cond:
            now = time.time()
            self._faults = [f for f in self._faults if f.live(now)]
            if not self._faults:
                return None
            fault = self._faults[0]
            fault.hits += 1
            if fault.remaining is not None:
                fault.remaining -= 1
            return fault

    def hold(self, fault: Fault, stopping: Callable[[], bool]) -> None:
        """Block a hanging request until the faults are cleared, its fault expires, or the server stops."""
        limit = HANG_MAX_SECONDS if fault.until is None else min(HANG_MAX_SECONDS, fault.until - time.time())
        with self._cond:
            clears = self._clears
            self._cond.wait_for(lambda: stopping() or self._clears != clears, timeout=max(0.0, limit))

    def clear(self) -> int:
        with self._cond:
            count = len(self._faults)
            for fault in self._faults:
                fault.cleared = True
            self._faults = []
            self._clears += 1
            self._cond.notify_all()
            return count

    def to_json(self) -> list[dict[str, Any]]:
        with self._cond:
            return [f.to_json() for f in self._faults]
