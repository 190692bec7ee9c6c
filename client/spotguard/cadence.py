"""How often to checkpoint: the Young/Daly optimum interval, and a per-step planner.

Saving costs ``C`` seconds; a failure loses, on average, half the interval ``T`` since the last
save. With failures arriving at mean interval ``M`` (the MTBF) the wasted fraction is about
``C/T + T/(2M)``, minimised by Young's first-order optimum ``T = sqrt(2*M*C)`` (J. W. Young, "A
first order approximation to the optimum checkpoint interval", CACM 17(9), 1974). J. T. Daly's
higher-order estimate ("A higher order estimate of the optimum checkpoint interval for restart
dumps", Future Generation Computer Systems 22(3), 2006) also accounts for failures during saves and
restarts::

    T = sqrt(2*C*M) * (1 + sqrt(C/(2M))/3 + (C/(2M))/9) - C    for C < 2M,   else T = M

Worked example: C = 30 s, M = 3 h gives Young 805 s and Daly 785 s: save about every 13 minutes.

The waste curve is flat near its minimum: an MTBF wrong by a factor k moves T by sqrt(k) and raises
the waste by (sqrt(k) + 1/sqrt(k)) / 2, i.e. only 25 % for k = 4. That is why one rough default,
:data:`DEFAULT_NODE_MTBF_S` (6 h), is usable until you have measured your own figure.

One default, everywhere: ``spotguard.Run`` without a daemon, the daemon's prior on every platform
(``none`` included: a platform the daemon cannot name is no evidence of a dedicated node, and Slurm
preemption or a drill runs there), ``spotguard cadence`` and ``spotguard drill`` all assume
:data:`DEFAULT_NODE_MTBF_S` unless told otherwise (``cadence.node_mtbf_hours``, ``--mtbf-hours``,
``Cadence(mtbf_s=...)``). On dedicated (non-spot) GPU nodes set about 6000 h
(:data:`DEDICATED_NODE_MTBF_S`).

Learning the MTBF (:func:`learned_mtbf`): the daemon counts a job's interruptions ``n`` (restarts
from a checkpoint, on any node) over its running time ``t`` and treats them as a Poisson process of
unknown rate ``r`` with a Gamma prior worth ``w`` interruptions at the prior MTBF ``M0``
(``Gamma(w, w*M0)``). The posterior is ``Gamma(w + n, w*M0 + t)``; the expected waste ``C/T +
E[r]*T/2`` is linear in ``r``, so the interval that minimises it under the posterior uses
``M = 1/E[r] = (w*M0 + t) / (w + n)``, never below a floor (a crash loop is not a preemption
rate). The prior dominates while ``t`` is small against ``w*M0``; after ``n`` interruptions the
rate is known to about ``1/sqrt(w + n)``, which moves the interval by half that and the waste by
far less (the curve is flat).

Distributed multiplier: one preemption of any of ``N`` nodes stops all of them and all roll back
(``N`` times the compute lost), so the job's MTBF is the node's divided by ``N``
(:func:`job_mtbf`) and the interval shrinks by ``sqrt(N)``. A node-level figure (a setting, a
published rate) is divided so; a count of the job's own restarts is already per job.

Exceptions::

    ValueError               a non-positive, non-finite or contradictory input
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections import deque
from typing import Any, Literal, Mapping

__all__ = [
    "NODE_MTBF_S",
    "DEFAULT_NODE_MTBF_S",
    "DEFAULT_MTBF_SOURCE",
    "DEDICATED_NODE_MTBF_S",
    "young_interval",
    "daly_interval",
    "job_mtbf",
    "node_mtbf",
    "steps_between",
    "expected_waste",
    "learned_mtbf",
    "job_nodes",
    "DEFAULT_PRIOR_WEIGHT",
    "DEFAULT_MTBF_FLOOR_S",
    "Cadence",
]

log = logging.getLogger(__name__)

_HOUR = 3600.0
DEFAULT_NODE_MTBF_S = 6 * _HOUR
"""The node MTBF every part of spotguard assumes when none is given (see the module docstring): a
deliberately pessimistic guess for one spot/preemptible GPU node, reclaimed far more often than the
average instance; replace it with the MTBF you observe. Not a measured figure: AWS's Spot Instance
Advisor buckets are monthly fractions over all sizes, Google once quoted 5-15 %/day for preemptible
VMs (GPU Spot is reclaimed far more often), Azure shows eviction-rate buckets, Alibaba nothing."""
DEFAULT_MTBF_SOURCE = "the default for one spot/preemptible node, a guess"
"""How every planner names :data:`DEFAULT_NODE_MTBF_S` where it shows it."""
DEDICATED_NODE_MTBF_S = 6000 * _HOUR
"""Dedicated (non-spot) GPU nodes, measured: Meta's Llama 3 report (419 unexpected interruptions in
54 days on 16,384 H100s = 2,048 8-GPU nodes, a job MTBF of about 3 h). Never assumed: set it."""

NODE_MTBF_S: dict[str, float] = dict.fromkeys(("aws", "gcp", "azure", "alibaba", "none"),
                                              DEFAULT_NODE_MTBF_S)
"""Each platform's default node MTBF: :data:`DEFAULT_NODE_MTBF_S` for all of them (one story)."""


DEFAULT_PRIOR_WEIGHT = 1.0
"""The prior counts as this many interruptions: one real interruption halves its pull."""
DEFAULT_MTBF_FLOOR_S = 300.0
"""The learned MTBF never goes below this: a job that restarts every few seconds is crashing,
and checkpointing every second would not save it."""


def _positive(name: str, value: float) -> float:
    """``value`` as a float if it is finite and > 0, else ValueError naming ``name``."""
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def young_interval(mtbf_s: float, cost_s: float) -> float:
    """Young's optimum seconds between checkpoints: ``sqrt(2 * mtbf_s * cost_s)``."""
    return _sqrt_2mc(_positive("mtbf_s", mtbf_s), _positive("cost_s", cost_s))


def daly_interval(mtbf_s: float, cost_s: float) -> float:
    """Daly's (2006) higher-order optimum seconds between checkpoints; ``mtbf_s`` once C >= 2M."""
    m, c = _positive("mtbf_s", mtbf_s), _positive("cost_s", cost_s)
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return _sqrt_2mc(m, c) * (1 + math.sqrt(x) / 3 + x / 9) - c


def _sqrt_2mc(m: float, c: float) -> float:
    """``sqrt(2*m*c)`` without overflow for huge (finite) MTBFs."""
    return math.sqrt(2.0) * math.sqrt(m) * math.sqrt(c)


def job_mtbf(node_mtbf_s: float, nodes: int) -> float:
    """MTBF of a job that dies when any of ``nodes`` independent nodes fails: node_mtbf / nodes."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    return _positive("node_mtbf_s", node_mtbf_s) / nodes


def node_mtbf(platform: str) -> float:
    """The default node MTBF in seconds for ``platform`` (a key of :data:`NODE_MTBF_S`)."""
    try:
        return NODE_MTBF_S[platform]
    except KeyError:
        known = ", ".join(sorted(NODE_MTBF_S))
        raise ValueError(f"unknown platform {platform!r}; known: {known}") from None


def steps_between(interval_s: float, step_time_s: float) -> int:
    """Whole steps that fit in ``interval_s``, rounded down (save early, never late); at least 1."""
    ratio = _positive("interval_s", interval_s) / _positive("step_time_s", step_time_s)
    return max(1, int(ratio)) if math.isfinite(ratio) else 2**62


def expected_waste(interval_s: float, mtbf_s: float, cost_s: float) -> float:
    """First-order fraction of time lost to saving and to rework: ``C/T + T/(2M)``."""
    return cost_s / interval_s + interval_s / (2 * mtbf_s)


def learned_mtbf(prior_mtbf_s: float, interruptions: int, running_s: float, *,
                 prior_weight: float = DEFAULT_PRIOR_WEIGHT,
                 floor_s: float = DEFAULT_MTBF_FLOOR_S) -> float:
    """The job MTBF to plan with after ``interruptions`` in ``running_s`` seconds of running, from
    a Gamma prior worth ``prior_weight`` interruptions at ``prior_mtbf_s`` (see the module
    docstring): ``(prior_weight*prior_mtbf_s + running_s) / (prior_weight + interruptions)``, at
    least ``floor_s``."""
    prior, weight = _positive("prior_mtbf_s", prior_mtbf_s), _positive("prior_weight", prior_weight)
    floor = _positive("floor_s", floor_s)
    if isinstance(interruptions, bool) or not isinstance(interruptions, int) or interruptions < 0:
        raise ValueError(f"interruptions must be an integer >= 0, got {interruptions!r}")
    if not (math.isfinite(running_s) and running_s >= 0):
        raise ValueError(f"running_s must be a finite number >= 0, got {running_s!r}")
    return max(floor, (weight * prior + running_s) / (weight + interruptions))


def job_nodes(environ: Mapping[str, str] = os.environ) -> int:
    """Nodes the job spans, as its launcher says (torchrun's ``WORLD_SIZE / LOCAL_WORLD_SIZE``);
    1 outside a launcher or when the figures make no sense."""
    try:
        world, local = int(environ.get("WORLD_SIZE", "1")), int(environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return 1
    local = local or world
    return max(1, world // local) if world >= 1 and local >= 1 else 1


class Cadence:
    """Tells the training loop when to checkpoint; O(1) and allocation-free per step.

    The loop reports what it measures and asks one question per step::

        cadence = Cadence(platform="aws", nodes=4)
        for step in range(start, total):
            t0 = time.perf_counter(); train_step(); cadence.observe_step(time.perf_counter() - t0)
            if cadence.due(step):
                save(...)                       # later: cadence.observe_save(blocking_s, persist_s)

    ``due`` counts steps from an anchor: the step of its first call (so a resumed run does not save
    again at once) and then every step for which it answered True. :meth:`mark_saved` re-anchors
    after a save made for another reason (a preemption notice, the end of an epoch).

    The plan: a fixed ``every_steps``, or an interval (fixed ``every_seconds``, else Young or Daly
    from the checkpoint cost C and the job MTBF) turned into steps by the measured step time. C is
    the median of the last five saves' ``blocking + persist`` seconds (a save protects nothing until
    it is durable; the median ignores a slow first save), ``cost_s`` until one is observed. Step
    time is an EWMA of observed steps; until one is observed an interval-based plan answers False.

    :meth:`use_mtbf` replaces the job MTBF with a learned one (the daemon's estimate, which
    ``spotguard.Run`` passes on; ``learn=False`` keeps the one given here) and re-plans.
    :meth:`floor` keeps a planned interval (Young or Daly) from going below the time a commit takes
    to become durable (the daemon's measure): saves faster than the store can take would all be
    superseded, and protect nothing more.

    Distributed jobs: every rank must decide alike or collective saves deadlock. The Cadence never
    communicates: agree its answer across ranks (``spotguard.Run`` all-reduces it and calls
    :meth:`mark_saved` on every rank), or use ``every_steps``.
    """

    _EWMA = 0.1
    """Weight of the newest step time: follows a change within ~20 steps, smooths jitter."""

    def __init__(
        self,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        mtbf_s: float | None = None,
        platform: str | None = None,
        nodes: int = 1,
        cost_s: float = 30.0,
        formula: Literal["young", "daly"] = "daly",
        learn: bool = True,
    ) -> None:
        if every_steps is not None and every_seconds is not None:
            raise ValueError("give every_steps or every_seconds, not both")
        if mtbf_s is not None and platform is not None:
            raise ValueError("give mtbf_s or platform, not both")
        if formula not in ("young", "daly"):
            raise ValueError(f"formula must be 'young' or 'daly', got {formula!r}")
        if every_steps is not None and (isinstance(every_steps, bool) or every_steps < 1):
            raise ValueError(f"every_steps must be an integer >= 1, got {every_steps!r}")
        node = mtbf_s if mtbf_s is not None else (
            node_mtbf(platform) if platform is not None else DEFAULT_NODE_MTBF_S)
        self.mtbf_s = job_mtbf(_positive("mtbf_s", node), nodes)
        self.learn = learn
        self.mtbf_source = "given" if mtbf_s is not None else "default"
        """Where :attr:`mtbf_s` came from: ``given``, ``default`` (a platform's guess) or ``learned``."""
        self._followed: Any = None
        self._fixed_steps = int(every_steps) if every_steps is not None else None
        self._fixed_interval = (
            _positive("every_seconds", every_seconds) if every_seconds is not None else None)
        self._formula = young_interval if formula == "young" else daly_interval
        self._costs: deque[float] = deque(maxlen=5)
        self.floor_s = 0.0
        """The shortest planned interval: the time a commit takes to become durable (:meth:`floor`)."""
        self.cost_s = _positive("cost_s", cost_s)
        self.step_s: float | None = None
        self._anchor: int | None = None
        self.interval_s = 0.0
        self.steps: int | None = None
        self._replan()

    def observe_step(self, seconds: float) -> None:
        """Fold one step's duration (seconds, >= 0) into the step-time EWMA and re-plan."""
        if not seconds >= 0:  # also rejects NaN
            raise ValueError(f"step seconds must be >= 0, got {seconds!r}")
        prev = self.step_s
        self.step_s = seconds if prev is None else prev + self._EWMA * (seconds - prev)
        self._replan_steps()

    def observe_save(self, blocking_s: float, persist_s: float = 0.0) -> None:
        """Record one save: ``blocking_s`` the loop waited, ``persist_s`` until it was durable.

        A total of 0 (an unmeasured save) carries no information and is ignored.
        """
        if not (blocking_s >= 0 and persist_s >= 0):  # also rejects NaN
            raise ValueError(f"save seconds must be >= 0, got {blocking_s!r}, {persist_s!r}")
        if blocking_s + persist_s == 0:
            return
        self._costs.append(blocking_s + persist_s)
        self.cost_s = statistics.median(self._costs)
        self._replan()

    def use_mtbf(self, mtbf_s: float) -> bool:
        """Plan with the learned job MTBF ``mtbf_s`` (seconds) from now on, unless built with
        ``learn=False``; True when it was taken."""
        mtbf = _positive("mtbf_s", mtbf_s)
        if not self.learn:
            return False
        self.mtbf_s, self.mtbf_source = mtbf, "learned"
        self._replan()
        return True

    def follow(self, rate: Any) -> None:
        """Plan with a daemon's :class:`~spotguard.protocol.JobRate` (its ``mtbf_s``) when it is a
        new one; logged when the MTBF moves by more than 10 %. O(1): called at every step boundary."""
        if rate is None or rate is self._followed:
            return
        self._followed, before = rate, self.mtbf_s
        if self.use_mtbf(rate.mtbf_s) and abs(rate.mtbf_s - before) > 0.1 * before:
            log.info("job MTBF learned by the daemon: %.0f s (%d interruptions in %.0f s of running, "
                     "prior %.0f s for %d node(s)); checkpoint every %.1f s", rate.mtbf_s,
                     rate.interruptions, rate.running_s, rate.prior_mtbf_s, rate.nodes, self.interval_s)

    def floor(self, durable_s: float | None) -> None:
        """Never plan saves closer than ``durable_s`` seconds (the time to durable; None: no news).
        O(1): called at every step boundary; a fixed ``every_steps``/``every_seconds`` is kept."""
        if durable_s is None or durable_s == self.floor_s:
            return
        binds = self._formula(self.mtbf_s, self.cost_s) < durable_s
        if binds and abs(durable_s - self.floor_s) > 0.1 * max(self.floor_s, 1e-9):
            log.info("checkpoints take %.0f s to become durable, longer than the planned interval; "
                     "checkpoint every %.0f s", durable_s, durable_s)
        self.floor_s = float(durable_s)
        self._replan()

    def due(self, step: int) -> bool:
        """True if the loop should save at ``step``; a True answer re-anchors the count there."""
        if self._anchor is None:
            self._anchor = step
            return False
        if self.steps is None or step - self._anchor < self.steps:
            return False
        self._anchor = step
        return True

    def mark_saved(self, step: int) -> None:
        """Count the next interval from ``step`` (a save the cadence did not ask for)."""
        self._anchor = step

    def _replan(self) -> None:
        if self._fixed_interval is not None:
            self.interval_s = self._fixed_interval
        else:
            self.interval_s = max(self._formula(self.mtbf_s, self.cost_s), self.floor_s)
        self._replan_steps()

    def _replan_steps(self) -> None:
        if self._fixed_steps is not None:
            self.steps = self._fixed_steps
        elif self.step_s is None:
            self.steps = None
        else:
            self.steps = steps_between(self.interval_s, max(self.step_s, 1e-9))

    def __repr__(self) -> str:
        return (f"Cadence(steps={self.steps}, interval_s={self.interval_s:.1f}, "
                f"cost_s={self.cost_s:.2f}, mtbf_s={self.mtbf_s:.0f}, step_s={self.step_s})")
