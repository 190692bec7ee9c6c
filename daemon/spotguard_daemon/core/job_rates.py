"""How often each job is interrupted, learned from what the goodput ledger saw: the MTBF to plan with.

The ledger (:mod:`.goodput`) counts per job its interruptions (restarts of rank 0 from a checkpoint:
on this node, and through the job's record in the durable store, :mod:`.goodput_store`, on the nodes
it ran on before) and its running time (between consecutive progress reports of one process).
:class:`JobRates` turns them into a :class:`~spotguard.protocol.JobRate` with
:func:`spotguard.cadence.learned_mtbf`: a Gamma-Poisson estimate over a prior worth
``cadence.prior_weight`` interruptions at the node MTBF ``cadence.node_mtbf_hours`` (unset: the
platform's rough default, :data:`spotguard.cadence.NODE_MTBF_S`) divided by the nodes the job spans
(the distributed multiplier: any node's preemption stops all of them), never below
``cadence.min_mtbf_seconds``.

Where it goes: the reply to each ``progress`` report (``spotguard.Run`` plans its Young/Daly
interval with it), the ``cadence`` request (``spotguard cadence --job``), and the gauges
``spotguard_job_mtbf_seconds{job}`` and ``spotguard_job_interruptions{job}`` for the ``MAX_GAUGED``
most recently active jobs: a snapshot taken on the daemon's loop (:meth:`JobRates.snapshot`), read
by the scrape thread.

What counts: every registered restart from a checkpoint is one interruption, whatever ended the run
before it (a preemption, a kill, a crash), except a stop for drill notices only (rank 0 reported safe
for them: ``spotguard drill``, ``spotguard notify``), and only on evidence (the previous run trained
and its process is gone: :mod:`.goodput`, :mod:`.handlers`). A job relaunched by hand after a deliberate stop
counts one too; a daemon without a durable store starts a job that moved to this node afresh.

Exceptions: none; a figure outside the protocol's bounds is clamped into them (the interruptions
at ``goodput.MAX_INTERRUPTIONS``).
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from spotguard.cadence import DEFAULT_MTBF_SOURCE, NODE_MTBF_S, job_mtbf, learned_mtbf, node_mtbf
from spotguard.protocol import MAX_MTBF, JobRate

from spotguard_daemon.core.goodput import MAX_INTERRUPTIONS, GoodputLedger, JobRecord

__all__ = ["JobRates", "MAX_GAUGED"]

log = logging.getLogger(__name__)

MAX_GAUGED = 64
"""Jobs with a gauge: the most recently active ones (a job id is free text; the series stay few)."""


class JobRates(Collector):
    """Each job's :class:`JobRate` from ``ledger``; also the collector of its gauges."""

    def __init__(self, ledger: GoodputLedger, *, platform: str, node_mtbf_hours: float | None = None,
                 prior_weight: float = 1.0, min_mtbf_seconds: float = 300.0) -> None:
        self.ledger, self.platform, self.node_mtbf_hours = ledger, platform, node_mtbf_hours
        """``platform``: the detected one (the daemon sets it once detection ran)."""
        self.prior_weight, self.floor_s = prior_weight, min_mtbf_seconds
        self._gauged: tuple[JobRate, ...] = ()
        self._failed: set[str] = set()

    @property
    def node_prior_s(self) -> float:
        """The prior node MTBF: the setting, else the platform's rough default."""
        if self.node_mtbf_hours is not None:
            return self.node_mtbf_hours * 3600
        return node_mtbf(self.platform if self.platform in NODE_MTBF_S else "none")

    @property
    def node_prior_source(self) -> str:
        """Where :attr:`node_prior_s` comes from, in words (``spotguard status``, the register reply)."""
        return "cadence.node_mtbf_hours" if self.node_mtbf_hours is not None else DEFAULT_MTBF_SOURCE

    def rate(self, job: str) -> JobRate | None:
        """The job's estimate now, or None when the ledger knows nothing of it."""
        record = self.ledger.record(job)
        return None if record is None else self._estimate(job, record)

    def snapshot(self) -> None:
        """Take the gauges' values (on the daemon's loop, which owns the ledger); a job whose
        estimate fails (a bug: every figure is clamped) is left out, logged once."""
        gauged = []
        for job, record in self.ledger.recent(MAX_GAUGED):
            try:
                gauged.append(self._estimate(job, record))
            except ValueError as exc:
                if job not in self._failed:
                    log.error("no MTBF estimate for job %r: %s", job[:64], str(exc)[:200])
                    if len(self._failed) < MAX_GAUGED:
                        self._failed.add(job)
        self._gauged = tuple(gauged)

    def _estimate(self, job: str, record: JobRecord) -> JobRate:
        nodes = max(1, min(record.nodes, 2**20))
        prior = min(job_mtbf(self.node_prior_s, nodes), MAX_MTBF)
        running = min(record.running, MAX_MTBF) if record.running >= 0 else 0.0  # nan: 0
        running = running if math.isfinite(running) else 0.0
        interruptions = max(0, min(int(record.interruptions), MAX_INTERRUPTIONS))
        mtbf = learned_mtbf(prior, interruptions, running, prior_weight=self.prior_weight,
                            floor_s=self.floor_s)
        return JobRate(job_id=job, mtbf_s=min(mtbf, MAX_MTBF), prior_mtbf_s=prior,
                       prior_weight=self.prior_weight, floor_s=min(self.floor_s, MAX_MTBF),
                       interruptions=interruptions, running_s=running, nodes=nodes)

    def describe(self) -> list:
        return []  # values exist only at scrape time

    def collect(self) -> Iterable[GaugeMetricFamily]:
        mtbf = GaugeMetricFamily("spotguard_job_mtbf_seconds", "The MTBF a job's checkpoint cadence "
                                 "plans with, learned from its interruptions over a prior.", labels=["job"])
        count = GaugeMetricFamily("spotguard_job_interruptions", "Restarts of a job from a checkpoint "
                                  "seen over all its runs (on this node or, through the store, before).",
                                  labels=["job"])
        for rate in self._gauged:
            mtbf.add_metric([rate.job_id], rate.mtbf_s)
            count.add_metric([rate.job_id], rate.interruptions)
        yield mtbf
        yield count
