"""How far this node's commits are behind the newest global step, and the re-check of incomplete steps.

A step of a job with node-local roots becomes *global* once every node's part is in the store and
some node wrote the global manifest (:mod:`spotguard.storage._parts`); on one node, a durable step is
global at once. Two things can keep a step from ever becoming global, and this module bounds both:

* **A node that uploads slower than the job saves.** Each newer commit supersedes the upload in
  flight, so with saves faster than the upload no part is ever finished. :meth:`GlobalWatch.finish`
  tells the queue to finish the upload in flight instead, once this node's oldest commit that is not
  global yet is older than ``storage.durable_lag_seconds``, or once ``storage.max_superseded``
  uploads of the job in a row were superseded; and the next ones too, as long as a newer commit
  overtakes each (the count of supersedes stays until an upload is not overtaken: the uploads are
  behind the saves until then, said once at WARNING). The lag between a commit and its global step
  stays bounded by about that bound plus one upload, then by about two uploads.
* **A part uploaded before the others, or a store whose listing lags.** The node whose upload
  completes the set writes the global manifest; when no upload sees the set complete (the parts
  landed together, or the listing lagged), nothing would. So the newest incomplete step of each job
  is checked again (:meth:`~spotguard.storage.durable.Durable.complete`) while the worker is idle,
  5 s after the upload, then doubling up to :data:`RECHECK_MAX`, until it is global or a newer step is.

``spotguard_upload_global_lag_seconds`` is the lag: seconds since this node's oldest commit that no
global step covers yet (0 when the newest is global), the metric the ``SpotguardGlobalStepStale``
alert watches. Thread-safe.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from typing import Any

__all__ = ["GlobalWatch", "RECHECK_FIRST", "RECHECK_MAX"]

log = logging.getLogger(__name__)

RECHECK_FIRST = 5.0
RECHECK_MAX = 120.0


class GlobalWatch:
    """Per job: the newest step known global, the lag, the supersedes in a row, the step to re-check."""

    def __init__(self, lag_bound: float, max_superseded: int) -> None:
        self.lag_bound, self.max_superseded = lag_bound, max_superseded
        self._lock = threading.Lock()
        self._global: dict[str, int] = {}
        self._behind: dict[str, tuple[float, int]] = {}
        """job -> (since when a commit is not global, the newest such step)."""
        self._superseded: dict[str, int] = {}
        self._recheck: dict[str, tuple[int, float, float]] = {}
        """job -> (step, when to check again, the wait after that)."""
        self._finishing: dict[str, int] = {}
        """job -> the step whose upload is finished although superseded (said once)."""
        self._behind_saves: dict[str, str] = {}
        """job -> why its uploads are finished although overtaken, from the first such one until one
        is not overtaken (warned once per episode, not per upload)."""
        self._to_durable: dict[str, deque[float]] = {}
        """job -> seconds from commit to durable of its last uploads (:meth:`time_to_durable`)."""

    def submitted(self, job: str, step: int) -> None:
        with self._lock:
            if step <= self._global.get(job, -1):
                return
            since, _ = self._behind.get(job, (time.time(), step))
            self._behind[job] = (since, step)

    def superseded(self, job: str) -> None:
        with self._lock:
            self._superseded[job] = self._superseded.get(job, 0) + 1

    def uploaded(self, job: str, step: int, complete: bool, committed_at: float | None = None,
                 overtaken: bool = False) -> None:
        """This node's part (or checkpoint) of ``step`` is in the store; ``complete``: the step is
        global; ``committed_at``: when it was committed (unix time), for :meth:`time_to_durable`;
        ``overtaken``: a newer commit came while it was sent, so the uploads are still behind the
        saves and the next one is finished too (the count of supersedes stays)."""
        with self._lock:
            if not overtaken:
                self._superseded.pop(job, None)
                if self._behind_saves.pop(job, None) is not None:
                    log.info("uploads of %s keep up with its saves again (step %d was not overtaken)", job, step)
            if committed_at is not None:
                self._to_durable.setdefault(job, deque(maxlen=5)).append(max(0.0, time.time() - committed_at))
        if complete:
            self.committed(job, step)
            return
        with self._lock:
            if step > self._recheck.get(job, (-1, 0.0, 0.0))[0] and step > self._global.get(job, -1):
                self._recheck[job] = (step, time.time() + RECHECK_FIRST, RECHECK_FIRST)

    def committed(self, job: str, step: int) -> None:
        """``step`` of ``job`` is global (this node wrote it, or found it)."""
        with self._lock:
            if step <= self._global.get(job, -1):
                return
            self._global[job] = step
            if job in self._recheck and self._recheck[job][0] <= step:
                del self._recheck[job]
            behind = self._behind.get(job)
            if behind is not None and behind[1] <= step:
                del self._behind[job]
            elif behind is not None:  # newer commits wait: counted from this global commit
                self._behind[job] = (time.time(), behind[1])

    def global_step(self, job: str) -> int:
        """The newest step of ``job`` known global here (-1: none)."""
        with self._lock:
            return self._global.get(job, -1)

    def finish(self, job: str) -> str | None:
        """Why the upload in flight of ``job`` must be finished although superseded (None: let it go)."""
        with self._lock:
            lag = self._lag(job, time.time())
            if self.lag_bound and lag >= self.lag_bound:
                return f"nothing newer is global for {lag:.0f} s (storage.durable_lag_seconds={self.lag_bound:g})"
            count = self._superseded.get(job, 0)
            if self.max_superseded and count >= self.max_superseded:
                return f"{count} uploads in a row were superseded (storage.max_superseded={self.max_superseded})"
        return None

    def finish_anyway(self, job: str, step: int, starting: bool = False) -> bool:
        """Whether the upload of ``step``, superseded (or, ``starting``, about to start), is finished
        all the same (:meth:`finish`); the warning is said once per upload."""
        if self._finishing.get(job) == step:
            return True
        why = self.finish(job)
        if why is not None:
            self._finishing[job] = step
            with self._lock:
                first = self._behind_saves.setdefault(job, why) is why
            (log.warning if first else log.info)(
                "finishing the upload of %s step %d %s: %s%s", job, step,
                "whatever newer checkpoints come" if starting else "although a newer checkpoint is committed",
                why, "; so are the next ones while newer commits overtake them" if first else "")
        return why is not None

    def recheck(self, durable: Any, job: str, step: int) -> None:
        """Check again whether ``step``, whose part this node uploaded, is global now (or a newer one
        is): :meth:`Durable.complete <spotguard.storage.durable.Durable.complete>` writes the global
        manifest once every part is listed. Any store error: checked again later."""
        try:
            newest = durable.latest(job)
            if newest is not None and newest >= step:
                self.committed(job, newest)
            elif durable.complete(job, step):
                log.info("durable %s step %d: global on a later check", job, step)
                self.committed(job, step)
            else:
                self.checked(job, step)
        except Exception as exc:  # noqa: BLE001 - any SDK's transport error: check again later
            log.info("could not check whether %s step %d is global: %s", job, step, exc)
            self.checked(job, step)

    def time_to_durable(self, job: str) -> float | None:
        """The median seconds from commit to durable of the job's last 5 uploads (None: none yet):
        the client's cadence never plans saves closer together than this (the store cannot take them)."""
        with self._lock:
            seen = self._to_durable.get(job)
            return statistics.median(seen) if seen else None

    def due(self) -> tuple[str, int] | None:
        """A job whose incomplete step is due for a re-check, and that step."""
        now = time.time()
        with self._lock:
            return next(((job, step) for job, (step, when, _) in self._recheck.items() if when <= now), None)

    def checked(self, job: str, step: int) -> None:
        """A re-check of ``step`` found it still incomplete (or failed): try again later."""
        with self._lock:
            current = self._recheck.get(job)
            if current is not None and current[0] == step:
                wait = min(current[2] * 2, RECHECK_MAX)
                self._recheck[job] = (step, time.time() + wait, wait)

    def waits(self) -> list[float]:
        with self._lock:
            return [when - time.time() for _, when, _ in self._recheck.values()]

    def lag(self) -> float:
        """The largest lag of any job (the gauge)."""
        now = time.time()
        with self._lock:
            return max((self._lag(job, now) for job in self._behind), default=0.0)

    def _lag(self, job: str, now: float) -> float:
        behind = self._behind.get(job)
        return 0.0 if behind is None else max(0.0, now - behind[0])

    def status(self) -> dict[str, Any]:
        now = time.time()
        with self._lock:
            return {job: {"global_step": self._global.get(job), "lag_seconds": round(self._lag(job, now), 1),
                          "recheck_step": self._recheck.get(job, (None,))[0]}
                    for job in sorted(set(self._global) | set(self._behind) | set(self._recheck))}
