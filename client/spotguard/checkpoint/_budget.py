"""The CPU budget of a background persist, steered by what it costs the training steps.

Contract: a periodic save's background persist (write, hash, fsync) may use as much CPU as the
training loop leaves spare, as long as the loop's steps stay within ``target`` (3 %) of their time
before the persist began. :class:`Budget` turns that into the ``share`` (in cores) of the
:class:`~._workers.Throttle` the persist's threads pace themselves by:

- **Step times.** ``observe(seconds)`` is called at every step boundary (``Run`` does it; a loop of
  its own can call :meth:`.Checkpointer.observe_step`). Steps taken while no persist runs form the
  baseline (the last :data:`BASELINE` of them), with the process's CPU use over them: the cores the
  loop takes, so ``cores - used`` is what it leaves spare.
- **Steering.** While a persist runs, every :data:`WINDOW` steps the median step is compared with the
  baseline's median: above ``1 + target`` the share halves (down to :data:`FLOOR`), else it grows by
  half (up to the spare cores, or the starting share where the loop leaves less; at two cores or
  more the throttle stops pacing). Multiplicative both
  ways: a slowdown is undone within one window, and a machine with idle cores reaches the disk's
  speed within a few windows. The share is remembered for the next persist.
- **No step times** (a Checkpointer used without ``Run``, or the first steps of a job): the persist
  keeps the share it starts with, ``background_cpu_share`` (0.25 of a core), which kept steps within
  +1.8 % on a loaded 2-core machine; so it is never worse than the fixed cap this replaces.

Why: a fixed quarter of a core kept a 2-core machine's steps fast, but on a GPU node with dozens of
idle cores it stretched a 1 GiB persist to 5x the disk's time, and a 24 GB node part to minutes,
during which the newest state is not durable. Niceness alone does not protect the steps (idle gaps,
SMT siblings and memory bandwidth are shared whatever the priority), so the cost is measured where it
matters, in the steps themselves. An emergency save, or a caller waiting in ``wait()``, lifts the cap
at once (:meth:`~._workers.Throttle.lift`), whatever the budget says.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque

from spotguard.checkpoint._workers import Throttle

__all__ = ["Budget", "FLOOR", "WINDOW", "BASELINE"]

FLOOR = 0.05
"""The least share a persist gets: it must end, however loaded the machine."""
WINDOW = 5
"""Steps per decision while a persist runs."""
BASELINE = 16
"""Steps before a persist that make its baseline."""
GROW, SHRINK = 1.5, 0.5


class Budget:
    """Owns the share of the persist in flight; ``observe`` comes from the training thread, the
    throttle is read by the persist's threads (a float attribute: no lock needed for it)."""

    def __init__(self, start: float, target: float = 0.03, cores: int | None = None) -> None:
        self.share = self.start = start
        self.target = target
        self.cores = cores or len(os.sched_getaffinity(0))
        self._base: deque[tuple[float, float, float]] = deque(maxlen=BASELINE)
        """(step seconds, wall at its end, process CPU at its end) of steps outside a persist."""
        self._during: list[float] = []
        self._throttle: Throttle | None = None
        self._lock = threading.Lock()
        self.decisions: list[tuple[float, float, float]] = []
        """(median step during, baseline median, share after) of each decision: for tests, benchmarks."""

    def begin(self) -> Throttle:
        """The throttle of a persist that starts now."""
        throttle = Throttle(None, threads=2, adaptive=True)
        throttle.set(self.share)
        with self._lock:
            self._throttle, self._during = throttle, []
        return throttle

    def end(self) -> None:
        with self._lock:
            self._throttle = None

    def spare(self) -> float:
        """Cores the loop leaves idle, from its CPU use over the baseline steps (all cores when unknown)."""
        if len(self._base) < 2:
            return float(self.cores)
        (_, wall0, cpu0), (_, wall1, cpu1) = self._base[0], self._base[-1]
        used = (cpu1 - cpu0) / (wall1 - wall0) if wall1 > wall0 else 0.0
        return max(FLOOR, self.cores - used)

    def observe(self, seconds: float) -> None:
        """One training step took ``seconds`` (called at each step boundary)."""
        with self._lock:
            throttle = self._throttle
            if throttle is None:
                self._base.append((seconds, time.monotonic(), time.process_time()))
                return
            if throttle.lifted or len(self._base) < WINDOW:
                return  # no cap to steer, or no baseline to steer by
            self._during.append(seconds)
            if len(self._during) < WINDOW:
                return
            during, base = statistics.median(self._during), statistics.median(s for s, _, _ in self._base)
            self._during = []
            if during > base * (1 + self.target):
                self.share = max(FLOOR, self.share * SHRINK)
            else:
                self.share = min(max(self.spare(), self.start), self.share * GROW)
            throttle.set(self.share)
            self.decisions.append((during, base, self.share))
