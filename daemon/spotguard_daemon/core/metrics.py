"""Prometheus metrics of the daemon, in a registry of its own (tests build a fresh one each).

Names carry their unit and counters end in ``_total``; labels take small fixed value sets (a platform,
a kind, a watcher name, a poll outcome), never a notice id. :class:`Metrics` also implements the
watchers' :class:`~spotguard_daemon.core.watchers.base.PollObserver`, so the runner reports every poll here.

``spotguard_notices_pending`` (by kind and whether the kind terminates) and
``spotguard_clients_safe`` (registered clients that reported safe for every pending terminating notice)
are computed at scrape time too: the alert rules in ``deploy/prometheus/`` need "pending now", which a
counter of announcements cannot say.

``spotguard_notice_deadline_seconds`` is computed at scrape time from the pending notices: seconds
until the nearest deadline, negative once passed, NaN when nothing with a deadline is pending (so an
alert such as ``spotguard_notice_deadline_seconds < 60`` stays quiet).

Goodput (clients report it; older clients do not, and then these stay at zero):
``spotguard_job_restarts_total`` counts rank-0 processes that resumed from a checkpoint;
``spotguard_steps_redone_total`` adds, per restart, the newest step committed for that job through
this daemon minus the step resumed from: work committed but not resumed (e.g. lost with the node's
disk). ``spotguard_checkpoint_save_seconds`` is the time the loop was blocked per save.

The notice timeline (:mod:`.timeline`): ``spotguard_notice_stage_seconds{stage}`` is the seconds from
a terminating notice's detection to each stage of its handling, ``spotguard_notice_outcomes_total
{outcome}`` counts each notice's one outcome, and ``spotguard_notices_without_client_streak`` is how
many of the latest notices in a row found no registered client (for an alert).
Rank 0 also reports its progress (step reached, and when) every few seconds, and each restart adds
what it lost after the checkpoint it resumed from (:mod:`.goodput` has the exact rules):
``spotguard_steps_lost_total`` the newest reported step minus the job's last commit (the step
resumed from, or a newer commit not resumed: those steps are the ones re-run above);
``spotguard_time_lost_seconds_total`` the training time those steps took (from the last commit's
step reached to the newest report); ``spotguard_downtime_seconds_total`` from the newest report before the stop to
the relaunched rank 0's registration. ``spotguard_training_seconds_total`` adds the time between
consecutive progress reports of one process (its wall time training, saves included), the
denominator of a goodput ratio. Only the daemon of the node where rank 0 ran knows the reports; a
job relaunched on a fresh node is counted there from the copy of its record that daemon kept in the
durable store (:mod:`.goodput_store`), which lags by up to ``storage.progress_seconds``.

Losses are counted per tier: every figure counted per restart (restarts, steps re-run, steps and
time lost, downtime) carries the label ``tier``, where the checkpoint resumed from came from, as the
client said when it registered (``resumed_tier``): ``local`` (the node's own disk), ``peer`` (a
partner node's daemon), ``bucket`` (the durable store), or ``unknown`` (an older client, or an
integration that cannot tell), on a fresh node too. :data:`TIERS` are all its values; each series
exists from the start, at zero. The sum over ``tier`` (``sum without (tier)``) is the figure for
every restart.

Exceptions: none; the HTTP endpoint's bind error (``OSError``) reaches the caller of :meth:`serve`.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from spotguard.protocol import RESUME_TIERS, TERMINATING_KINDS, Notice, utcnow

from spotguard_daemon.core.goodput import Loss
from spotguard_daemon.core.timeline import OUTCOMES

__all__ = ["TIERS", "Metrics"]

log = logging.getLogger(__name__)

_POLL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
UNKNOWN_TIER = "unknown"
TIERS = (*RESUME_TIERS, UNKNOWN_TIER)
"""The values of the ``tier`` label of the per-restart figures (see the module docstring)."""


class Metrics:
    """Every metric of the daemon, registered in ``registry`` (a fresh one when not given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.notices = Counter("spotguard_notices_total", "Notices announced, by platform and kind.",
                               ["platform", "kind"], registry=r)
        self.polls = Counter("spotguard_poll_requests_total", "Watcher polls, by source and outcome.",
                             ["source", "outcome"], registry=r)
        self.poll_seconds = Histogram("spotguard_poll_duration_seconds", "Duration of one poll.",
                                      ["source"], buckets=_POLL_BUCKETS, registry=r)
        self.deadline = Gauge("spotguard_notice_deadline_seconds",
                              "Seconds until the nearest pending deadline (NaN when none).", registry=r)
        self.latency = Histogram("spotguard_notice_delivery_latency_seconds",
                                 "Seconds from a notice's detection to its publication to clients.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.clients = Gauge("spotguard_clients_connected", "Registered client processes.", registry=r)
        self.info = Gauge("spotguard_daemon_info", "Constant 1, labelled with the daemon's version "
                          "and platform.", ["version", "platform"], registry=r)
        self.requests = Counter("spotguard_requests_total", "Requests served, by type and outcome.",
                                ["type", "outcome"], registry=r)
        self.task_restarts = Counter("spotguard_daemon_task_failures_total",
                                     "Background loops of the daemon that failed (and were started "
                                     "again), by task.", ["task"], registry=r)
        self.deliveries = Counter("spotguard_deliveries_total", "Notice deliveries beside the sockets, "
                                  "by channel (signal, hook, webhook) and outcome.",
                                  ["channel", "outcome"], registry=r)
        by_tier = " By tier: where the checkpoint resumed from came from (local, peer, bucket, unknown)."
        self.restarts = Counter("spotguard_job_restarts_total", "Processes (rank 0) that registered "
                                "saying they resumed from a checkpoint." + by_tier, ["tier"], registry=r)
        self.steps_redone = Counter("spotguard_steps_redone_total", "Steps re-run after restarts: the "
                                    "newest step committed for the job on this daemon minus the step "
                                    "resumed from (steps after the newest commit are not seen)." + by_tier,
                                    ["tier"], registry=r)
        self.steps_lost = Counter("spotguard_steps_lost_total", "Steps trained after a job's last commit "
                                  "and trained again by its restart: newest progress reported minus "
                                  "the newest of the commits and the step resumed from." + by_tier,
                                  ["tier"], registry=r)
        self.time_lost = Counter("spotguard_time_lost_seconds", "Training seconds those lost steps "
                                 "took (last commit's step reached -> newest progress report)." + by_tier,
                                 ["tier"], registry=r)
        self.downtime = Counter("spotguard_downtime_seconds", "Seconds from a job's newest progress "
                                "report to the registration of its relaunched rank 0." + by_tier,
                                ["tier"], registry=r)
        for tier in TIERS:  # every series exists from the start, so increase() sees the first restart
            for counter in (self.restarts, self.steps_redone, self.steps_lost, self.time_lost, self.downtime):
                counter.labels(tier=tier)
        self.training = Counter("spotguard_training_seconds", "Seconds between consecutive progress "
                                "reports of running jobs (training wall time, saves included).", registry=r)
        self.save_seconds = Histogram("spotguard_checkpoint_save_seconds", "Seconds the training loop "
                                      "was blocked by one checkpoint save, as reported with its commit.",
                                      buckets=_SAVE_BUCKETS, registry=r)
        self.stage_seconds = Histogram("spotguard_notice_stage_seconds", "Seconds from a terminating "
                                       "notice's detection to each stage of its handling: published, "
                                       "signalled, a client's flag, stop, save committed (or already, no "
                                       "room, failed), safe, durable, gone.", ["stage"],
                                       buckets=_STAGE_BUCKETS, registry=r)
        self.outcomes = Counter("spotguard_notice_outcomes", "Terminating notices by outcome: saved (in "
                                "time), no_room, missed_deadline, no_client, cancelled.", ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every series exists from the start, so increase() sees the first one
            self.outcomes.labels(outcome=outcome)
        self.no_client_streak = Gauge("spotguard_notices_without_client_streak", "How many of the latest "
                                      "terminating notices in a row found no registered client.", registry=r)
        self.deadline.set(math.nan)
        self._server = None

    def set_info(self, version: str, platform: str) -> None:
        self.info.clear()
        self.info.labels(version=version, platform=platform).set(1)

    def track_deadline(self, pending: Callable[[], Iterable[Notice]]) -> None:
        """Compute the deadline gauge from ``pending()`` at every scrape."""
        def nearest() -> float:
            left = [n.seconds_left(utcnow()) for n in pending() if n.deadline is not None]
            return min(left) if left else math.nan
        self.deadline.set_function(nearest)

    def track_notices(self, pending: Callable[[], Iterable[Notice]],
                      clients_safe: Callable[[], int]) -> None:
        """Expose the pending notices by kind and the count of safe clients, read at every scrape."""
        self.registry.register(_PendingCollector(pending, clients_safe))

    # ------------------------------------------------------------------ observers

    def poll_done(self, watcher: object, outcome: str, seconds: float) -> None:
        """The :class:`PollObserver` hook: count the poll and time it."""
        source = getattr(watcher, "name", str(watcher))
        self.polls.labels(source=source, outcome=outcome).inc()
        self.poll_seconds.labels(source=source).observe(seconds)

    def notice_published(self, notice: Notice, latency: bool = True) -> None:
        """Count a notice and record its detection-to-publication latency (not for re-announced
        notices restored from a previous run, whose detection lies before this process)."""
        self.notices.labels(platform=notice.platform, kind=notice.kind.value).inc()
        if latency:
            self.latency.observe(max(0.0, (utcnow() - notice.received_at).total_seconds()))

    def notice_stage(self, stage: str, seconds: float) -> None:
        """A notice reached ``stage`` ``seconds`` after it was seen (:mod:`.timeline`)."""
        self.stage_seconds.labels(stage=stage).observe(seconds)

    def notice_outcome(self, outcome: str, no_client_streak: int) -> None:
        """A notice's outcome was decided; ``no_client_streak``: the latest in a row without a client."""
        self.outcomes.labels(outcome=outcome).inc()
        self.no_client_streak.set(no_client_streak)

    def request_served(self, kind: str, ok: bool) -> None:
        self.requests.labels(type=kind, outcome="ok" if ok else "error").inc()

    def resumed(self, steps_redone: int, tier: str | None = None) -> None:
        """A job restarted from a checkpoint that came from ``tier`` (None: ``unknown``), re-running
        ``steps_redone`` committed steps."""
        self.restarts.labels(tier=_tier(tier)).inc()
        self.redone(steps_redone, tier)

    def redone(self, steps: int, tier: str | None = None) -> None:
        """Add ``steps`` committed steps a restart from ``tier`` re-runs (negative: none)."""
        self.steps_redone.labels(tier=_tier(tier)).inc(max(0, steps))

    def lost(self, loss: Loss, tier: str | None = None) -> None:
        """Add what one restart from ``tier`` (None: ``unknown``) lost after its last commit
        (``seconds`` None: unknown, not added)."""
        tier = _tier(tier)
        self.steps_lost.labels(tier=tier).inc(loss.steps)
        self.time_lost.labels(tier=tier).inc(loss.seconds or 0.0)
        self.downtime.labels(tier=tier).inc(loss.downtime)

    def save_reported(self, seconds: float | None) -> None:
        if seconds is not None:
            self.save_seconds.observe(seconds)

    def delivered(self, channel: str, ok: bool) -> None:
        self.deliveries.labels(channel=channel, outcome="ok" if ok else "error").inc()

    # ------------------------------------------------------------------ endpoint

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` in a thread; return the port bound (for port 0)."""
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _tier(tier: str | None) -> str:
    """The ``tier`` label of a restart: one of :data:`TIERS`, ``unknown`` for None or anything else."""
    return tier if tier in RESUME_TIERS else UNKNOWN_TIER


class _PendingCollector(Collector):
    """``spotguard_notices_pending{kind,terminating}`` and ``spotguard_clients_safe`` at scrape time."""

    def __init__(self, pending: Callable[[], Iterable[Notice]], clients_safe: Callable[[], int]) -> None:
        self._pending, self._clients_safe = pending, clients_safe

    def describe(self) -> list:
        return []  # values exist only at scrape time; nothing to check for name clashes up front

    def collect(self) -> Iterable[GaugeMetricFamily]:
        pending = GaugeMetricFamily("spotguard_notices_pending", "Notices pending now, by kind.",
                                    labels=["kind", "terminating"])
        counts: dict[tuple[str, str], int] = {}
        for notice in self._pending():
            key = (notice.kind.value, str(notice.kind in TERMINATING_KINDS).lower())
            counts[key] = counts.get(key, 0) + 1
        for (kind, terminating), count in sorted(counts.items()):
            pending.add_metric([kind, terminating], count)
        yield pending
        yield GaugeMetricFamily("spotguard_clients_safe", "Registered clients that reported safe "
                                "for every pending terminating notice.", value=self._clients_safe())
