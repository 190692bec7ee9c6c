"""Retention of durable checkpoints: after each upload the queue keeps the newest ``storage.keep``
checkpoints of the job and deletes the objects nothing references any more
(:meth:`Durable.prune <spotguard.storage.durable.Durable.prune>`).

A retention that fails is retried with backoff until it succeeds, or a later upload's retention of
the job does, so a store that failed once never keeps extra checkpoints; but it is never urgent:
the queue runs a retry only when no upload is ready and no notice is pending, and waits at most
:data:`RETENTION_RETRY_MAX` between tries, so a bucket that never allows deletes (a policy without
``DeleteObject``) logs a few lines an hour, not a flood. ``status`` shows the jobs whose retention
is being retried.

Exceptions: none; a failed prune is logged and scheduled again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

__all__ = ["RETENTION_RETRY_MAX", "Retention", "backoff"]

log = logging.getLogger(__name__)

RETENTION_RETRY_MAX = 600.0
"""The longest wait between retries of a failed retention."""


def backoff(base: float, exponent: int, cap: float) -> float:
    """``base`` doubled ``exponent`` times (at most 10), never above ``cap``."""
    return min(cap, base * 2 ** min(exponent, 10))


class Retention:
    """Prunes a job (``prune(job_id)``) and keeps the jobs whose prune failed, with when to try
    again; ``first_delay`` is the first retry's wait (doubled after each failure). Thread-safe."""

    def __init__(self, prune: Callable[[str], Any], first_delay: float) -> None:
        self._prune, self.first_delay = prune, first_delay
        self._lock = threading.Lock()
        self._due: dict[str, tuple[float, int]] = {}
        """Jobs whose retention failed: when to try again, and how many tries failed so far."""

    def run(self, job_id: str) -> None:
        """Apply retention to ``job_id``; a failure is logged and scheduled again."""
        try:
            self._prune(job_id)
        except Exception as exc:  # noqa: BLE001 - any SDK's transport error: retry, never die
            with self._lock:
                failures = self._due.get(job_id, (0.0, 0))[1] + 1
                delay = backoff(self.first_delay, failures - 1, RETENTION_RETRY_MAX)
                self._due[job_id] = (time.time() + delay, failures)
            log.warning("retention of %s failed (attempt %d): %s; retrying in %.1fs", job_id, failures,
                        exc, delay)
        else:
            with self._lock:
                self._due.pop(job_id, None)

    def ready(self) -> str | None:
        """A job whose failed retention is due again, if any."""
        now = time.time()
        with self._lock:
            return next((job for job, (when, _) in self._due.items() if when <= now), None)

    def waits(self) -> list[float]:
        """Seconds until each retry is due."""
        with self._lock:
            return [when - time.time() for when, _ in self._due.values()]

    def status(self) -> dict[str, dict[str, Any]]:
        """``{job: {"failures": n, "at": unix time of the next try}}``."""
        with self._lock:
            return {job: {"failures": n, "at": when} for job, (when, n) in self._due.items()}
