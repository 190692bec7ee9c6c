"""The upload in flight: the hooks :meth:`Durable.upload <spotguard.storage.durable.Durable.upload>`
calls while it sends one checkpoint, which pace it and abandon it.

* **Paced.** ``storage.bandwidth_mbps`` is a cap on the bytes read, paid chunk by chunk before a
  chunk is read, so it holds inside a file and never bursts above the cap, even at the end.
* **Abandoned** at the next chunk read, inside a file, or after a file: :class:`Superseded` when a
  newer checkpoint of its job is queued (its objects stay in the bucket and the newer one reuses
  them), :class:`Preempted` when another job's newer checkpoint must go first while a notice is
  pending (it is queued again and resumes). The queue decides which (``why``); the first answer
  holds, so every file still in flight raises the same.

A pacing wait is a wait on the queue's condition, so that a newer commit ends it at once.

Exceptions: :class:`Superseded` and :class:`Preempted`, raised inside the upload's hooks; both are
:class:`~spotguard.storage.base.Interrupted`, which every store lets pass as itself.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from spotguard.storage.base import Interrupted

__all__ = ["Flight", "Preempted", "Superseded"]


class Superseded(Interrupted):
    """Raised inside an upload's hooks (before a chunk is read, after a file) to abandon it for a
    newer checkpoint."""


class Preempted(Interrupted):
    """Raised inside an upload's hooks to let another job's newer checkpoint go first
    while a notice is pending; the pre-empted upload is queued again (its objects are reused)."""


class Flight:
    """The hooks of one upload: :meth:`progress` (after each file) and :meth:`interrupt` (before
    each chunk is read). ``why()``, called with ``cond`` held, tells whether (and why) the upload
    is to be abandoned; ``on_progress(done, total)`` is told each file's progress, ``cond`` held."""

    def __init__(self, cond: threading.Condition, why: Callable[[], type[Exception] | None],
                 on_progress: Callable[[int, int], None], bytes_per_second: float | None) -> None:
        self.cond, self.why, self.on_progress = cond, why, on_progress
        self.bytes_per_second = bytes_per_second
        self.started = time.monotonic()
        self.read = 0
        self.abandon: type[Exception] | None = None
        """Why the upload is being abandoned, decided once: one reason drops the upload, the other
        requeues it, and every file still in flight must agree."""

    def progress(self, done: int, total: int) -> None:
        with self.cond:
            self.on_progress(done, total)
            self._check()

    def interrupt(self, n: int) -> None:
        with self.cond:
            self.read += n  # paid for before it is read: no burst above the cap, even at the end
            while True:
                self._check()
                ahead = self._ahead()
                if ahead <= 0:
                    break
                self.cond.wait(min(ahead, 1.0))

    def resume(self) -> None:
        """Go on after an abandonment was decided and then taken back (a follower's upload of the
        step node 0 proposed meanwhile)."""
        with self.cond:
            self.abandon = None

    def _check(self) -> None:
        """Raise why the upload is abandoned, if it is; ``cond`` held."""
        if self.abandon is None:
            self.abandon = self.why()
        if self.abandon is not None:
            raise self.abandon()

    def _ahead(self) -> float:
        """Seconds the upload is ahead of ``bytes_per_second`` (<= 0: go on)."""
        if not self.bytes_per_second:
            return 0.0
        return self.read / self.bytes_per_second - (time.monotonic() - self.started)
