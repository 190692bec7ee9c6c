"""The CPU budget of a background persist, steered by what it costs the training steps.

Contract: a periodic save's background persist (write, hash, fsync) may use as much CPU as the
training loop leaves spare, as long as the loop's steps stay within ``target`` (3 %) of their time
without it. :class:`Budget` turns that into the ``share`` (in cores) of the
:class:`~._workers.Throttle` the persist's threads pace themselves by:

- **Step times.** ``observe(seconds)`` is called at every step boundary (``Run`` does it; a loop of
  its own can call :meth:`.Checkpointer.observe_step`). Steps taken while no persist runs form the
  baseline (the last :data:`BASELINE` of them).
- **Spare cores.** Over the baseline, the idle time of the CPUs this process may run on
  (``/proc/stat``: what the loop, its loader workers and everything else on the node leave), no more
  than its cgroup's CPU quota leaves (a container's limit, :mod:`._cgroup`: beyond it the kernel
  throttles the whole pod, the loop too), split over the ranks of this node (``LOCAL_WORLD_SIZE``),
  each of which persists its own part. Where ``/proc/stat`` cannot be read, the cores less this
  process's CPU use.
- **The start.** The first persist with a baseline starts at :data:`SPARE_USE` of the spare cores,
  at least ``target`` of a core (and :data:`FLOOR`): on a GPU node with idle cores the persist runs
  at the disk's speed from its first chunk, rather than growing from a quarter of a core while the
  newest state is not durable; where the loop leaves no core idle, it starts, and stays, at
  ``target`` of a core (see :data:`FLOOR` for why). Later persists start where the last one ended.
- **Steering.** While a persist runs, every :data:`WINDOW` steps the median step is compared with the
  reference (the baseline's median): not above ``1 + target``, the share grows by half (up to
  :data:`SPARE_USE` of the spare cores, at least ``target`` of a core; at two cores or more the throttle
  stops pacing). Above it, the persist is held back (:meth:`~._workers.Throttle.pause`) for a control
  window of as many steps, which becomes the reference, then a fresh window runs with it: if that
  one runs more than ``target`` over the control, the share halves (down to :data:`FLOOR`), else it
  grows. The first step after each switch is dropped (work in flight). Why both: measured here with
  no persist at all, 56 % of 5-step windows ran over 3 % above the steps before them, so a stale
  baseline sank the budget to its floor on drift; and comparing the control with the window that
  looked slow, picked for being slow, found a "cost" of 5-40 % at every share (regression to the
  mean). The control costs the persist a few steps, only when steps look slower. The share is
  remembered for the next persist.
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
from collections.abc import Callable

from spotguard.checkpoint._cgroup import Quota, quota
from spotguard.checkpoint._workers import Throttle

__all__ = ["Budget", "FLOOR", "WINDOW", "BASELINE", "SPARE_USE", "idle_seconds"]

FLOOR = 0.03
"""The least share a persist gets (it must end, however loaded the machine). Where the loop leaves no
core idle, a persist starts and stays at ``target`` of a core (3 %: this floor), because there each
CPU second the persist takes is taken from the loop, whose threads wait for each other at every
step, whatever the persist's niceness: the steps run about ``share`` slower. Measured on 2 cores
both running the loop (1 GiB, 8 rounds, medians; benchmarks/README.md): starting at 0.25 of a core
(the old ``background_cpu_share`` floor) and steered, +3.7 %, durable in 15 s; at 0.03, +2.0 %,
durable in 24 s (the control, nothing persisting: -0.1 %). Steering alone could not find that: a
5-step window's noise there is larger than the 3 % it looks for."""
WINDOW = 5
"""Steps per decision while a persist runs."""
BASELINE = 16
"""Steps before a persist that make its baseline."""
GROW, SHRINK = 1.5, 0.5
SPARE_USE = 0.5
"""The part of the measured spare cores a persist may use: the first one starts there, and growing
stops there (the rest absorbs the cost a core's persist puts on the others: memory bandwidth, the
shared cache). Measured on 2 cores with one idle (1 GiB, 5 rounds, against a control with nothing
persisting): at 0.75, and growing up to the whole spare core, the steps ran +3.0 % (the control
-3.3 %), durable in 0.55x ``dd``; at 0.5 -1.6 % (the control -0.5 %), durable in 0.64x ``dd``."""
PAUSE_SLACK = 0.5
"""Seconds a control window's pause may run over twice its steps' expected time (it then ends by
itself: a loop that stops reporting steps, an eval, never holds the persist longer)."""
SAMPLE_EVERY = 0.2
"""Seconds between two readings of the CPUs' idle time (``/proc/stat``), whatever the step time."""
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def idle_seconds(cpus: set[int]) -> float | None:
    """Idle (and I/O wait) seconds of ``cpus`` since boot, from ``/proc/stat``; None where unreadable."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    ticks = 0
    for line in lines:
        if line.startswith(b"cpu") and line[3:4].isdigit():
            name, *fields = line.split()
            if int(name[3:]) in cpus and len(fields) >= 5:
                ticks += int(fields[3]) + int(fields[4])
    return ticks / _TICK


class Budget:
    """Owns the share of the persist in flight; ``observe`` comes from the training thread, the
    throttle is read by the persist's threads (a float attribute: no lock needed for it)."""

    def __init__(self, start: float, target: float = 0.03, cores: int | None = None,
                 idle: Callable[[], float | None] | None = None, cgroup: Quota | None | bool = True) -> None:
        self.share = start
        self.target = target
        self.busy_share = max(FLOOR, target)
        """Where the loop leaves no core idle: the steps run about the share slower (see :data:`FLOOR`)."""
        self.cores = cores or len(os.sched_getaffinity(0))
        self._base: deque[tuple[float, float, float]] = deque(maxlen=BASELINE)
        """(step seconds, wall at its end, process CPU at its end) of steps outside a persist."""
        cpus = os.sched_getaffinity(0)
        self._idle_now = idle or (lambda: idle_seconds(cpus))
        """The idle seconds of this process's CPUs so far (a test gives its own)."""
        self._idle: deque[tuple[float, float, float | None]] = deque(maxlen=BASELINE)
        """(wall, idle seconds of our CPUs, CPU seconds our cgroup used) sampled every
        :data:`SAMPLE_EVERY` outside a persist."""
        self._quota = quota() if cgroup is True else cgroup or None
        """The CPU quota of this process's cgroup (a container's limit), if it has one."""
        self.ranks = max(1, _int_env("LOCAL_WORLD_SIZE", 1))
        self.started = False
        """A persist began with a baseline: the next ones start from the share learned."""
        self._during: list[float] = []
        self._reference: float | None = None
        """The median step without the persist: the baseline's, then the last control window's."""
        self._phase = "steer"
        """``steer``: windows with the persist; ``control``: held back after one looked slow;
        ``check``: a fresh window with it, compared with the control window."""
        self._throttle: Throttle | None = None
        self._lock = threading.Lock()
        self.decisions: list[tuple[float, float, float]] = []
        """(median step with the persist, reference, share after) of each decision: tests, benchmarks."""

    def begin(self) -> Throttle:
        """The throttle of a persist that starts now."""
        throttle = Throttle(None, threads=2, adaptive=True)
        with self._lock:
            spare = self._measured_spare()
            if not self.started and spare is not None:
                self.started = True
                self.share = max(self.busy_share, SPARE_USE * spare)
            throttle.set(self.share)
            self._throttle, self._during, self._phase = throttle, [], "steer"
            self._reference = statistics.median(s for s, _, _ in self._base) if len(self._base) >= WINDOW else None
        return throttle

    def end(self) -> None:
        with self._lock:
            self._throttle = None
            self._idle.clear()  # the persist's own CPU is not the loop's: measure the spare anew

    def spare(self) -> float:
        """Cores this rank's persist may take (see the module docstring); all cores when unknown."""
        spare = self._measured_spare()
        return float(self.cores) if spare is None else spare

    def _measured_spare(self) -> float | None:
        """The idle cores over the baseline, split over the node's ranks; None without a baseline of
        :data:`SAMPLE_EVERY` seconds or more."""
        if len(self._idle) >= 2 and self._idle[-1][0] - self._idle[0][0] >= SAMPLE_EVERY:
            (wall0, idle0, used0), (wall1, idle1, used1) = self._idle[0], self._idle[-1]
            spare = (idle1 - idle0) / (wall1 - wall0)
            if self._quota is not None and used0 is not None and used1 is not None:
                spare = min(spare, self._quota.cores - (used1 - used0) / (wall1 - wall0))
            return max(FLOOR, spare / self.ranks)
        if len(self._base) < 2 or self._base[-1][1] - self._base[0][1] < SAMPLE_EVERY:
            return None
        (_, wall0, cpu0), (_, wall1, cpu1) = self._base[0], self._base[-1]
        return max(FLOOR, (self.cores - (cpu1 - cpu0) / (wall1 - wall0)) / self.ranks)

    def observe(self, seconds: float) -> None:
        """One training step took ``seconds`` (called at each step boundary)."""
        with self._lock:
            throttle = self._throttle
            if throttle is None:
                now = time.monotonic()
                self._base.append((seconds, now, time.process_time()))
                if not self._idle or now - self._idle[-1][0] >= SAMPLE_EVERY:
                    idle = self._idle_now()
                    if idle is not None:
                        self._idle.append((now, idle, self._quota.used() if self._quota else None))
                return
            if throttle.lifted or self._reference is None:
                return  # no cap to steer, or no baseline to steer by
            self._during.append(seconds)
            if len(self._during) < WINDOW + (self._phase != "steer"):  # the first step after a switch: mixed
                return
            window, self._during = statistics.median(self._during[-WINDOW:]), []
            if self._phase == "steer" and window > self._reference * (1 + self.target):
                self._phase = "control"  # the persist's cost, or the machine's drift? Steps without it say
                throttle.pause((WINDOW + 1) * 2 * self._reference + PAUSE_SLACK)
                return
            if self._phase == "control":
                held = throttle.paused
                throttle.resume()
                # Not the window that looked slow (picked for being slow, it would make any cost look
                # real): a fresh one with the persist is compared with this one without it.
                self._phase, self._reference = ("check", window) if held else ("steer", self._reference)
                return
            checked, self._phase = self._phase == "check", "steer"
            if checked and window > self._reference * (1 + self.target):
                self.share = max(FLOOR, self.share * SHRINK)
            else:
                self.share = min(max(SPARE_USE * self.spare(), self.busy_share), self.share * GROW)
            throttle.set(self.share)
            self.decisions.append((window, self._reference, self.share))


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
