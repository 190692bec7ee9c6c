"""Goodput bookkeeping per job: what a restart lost after the job's last commit.

The daemon learns three things about a job from its clients: progress reports from rank 0
(``progress``: step reached and when, at most every few seconds), commits (``commit``: a step was
saved), and restarts (``register`` with ``resumed_from_step`` R from rank 0). When a job restarts,
:meth:`GoodputLedger.restarted` compares what it knew of the previous run with R and returns a
:class:`Loss`:

* ``steps``: the newest reported step minus the job's last commit C (the newest of R and the steps
  committed since the previous restart; never negative): steps trained after the last commit and
  trained again by the restart. Committed steps not resumed (C - R) are counted apart, as steps
  re-run (:meth:`~spotguard_daemon.core.metrics.Metrics.resumed`);
* ``seconds``: the training time those steps took: the newest report's time minus the time step C was
  reached (the time the client stamped on the commit, ``reached_at``: a commit is reported after
  its write, often behind reports of later steps; a client that stamps none leaves an upper bound,
  the earlier of the commit's arrival and the newest report at or past C by then; for C = R not
  committed since, the previous restart's time). None when it is not known (a daemon without state);
* ``downtime``: the restart's registration minus the newest report's time: from the last report
  before the stop to the relaunched process having loaded its checkpoint.

Reports are sampled (one per ``progress_interval`` at most), so ``steps`` and ``seconds`` are lower
bounds by up to one interval and ``downtime`` an upper bound by as much; their sum is exact. Only
this node's daemon is told; a job whose rank 0 comes back on another node (a fresh node after a
preemption) is known there through the copy of its record that :mod:`.goodput_store` keeps in the
durable store (:meth:`GoodputLedger.due` hands it the records to write): :meth:`restarted` returns
None for a job this node knows nothing of, or knows only an older part of (the step resumed from is
past every step and commit this node saw: the job ran elsewhere since), and the caller asks the store.

Per tier: a restart's register also says where its checkpoint came from (``resumed_tier``: the
node's disk, a partner node, the durable store), and the caller (:mod:`.handlers`, or
:mod:`.goodput_store` for a recalled record) adds each :class:`Loss` to the metrics under that tier
(``unknown`` when not said; :mod:`.metrics`), so the losses are counted per tier. The ledger itself
keeps no tier: a loss is what the previous run left uncommitted, whatever the next run resumed from.

Interruptions and running time (for :mod:`.job_rates`, the MTBF a job's cadence plans with): each
record counts the job's restarts (``interruptions``) and the training seconds between consecutive
reports of one process (``running``), and :meth:`restarted` carries both into the new run's record.
An interruption is counted from evidence only, never from a register's claim alone: the previous
run trained (its process reported progress after its own start, ``JobRecord.ran``) and was not
stopped for drill notices only (:meth:`stopped`); the caller (:mod:`.handlers`) also makes sure
the previous process is gone and the new one is another process (a process registering again is no
restart). A job this node knows nothing of takes the counts from the store's copy
(:meth:`GoodputLedger.adopt`, once per run of the job here; one more for the restart that brought it
here when the stored run trained).

Bounds: at most ``MAX_JOBS`` jobs (the least recently updated are forgotten), ``MAX_COMMITS``
commit times per job, at most ``MAX_INTERRUPTIONS`` interruptions and ``MAX_RUNNING`` seconds per job
(every figure read, from the state file or the store, is checked against them). Persistence: ``<state_dir>/goodput.json`` (0600, atomic) is written at most every
``FLUSH_SECONDS`` while something changed (:meth:`GoodputLedger.flush`, called by the daemon's
housekeeping) and at shutdown, so a daemon restarted between a job's stop and its relaunch still
counts the loss; a daemon killed outright loses the last few seconds of reports.

Exceptions: :meth:`GoodputLedger.progress` raises ``ValueError`` for a report too old to trust; an
unreadable state file is logged and ignored, an unwritable one logged.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Callable

from spotguard_daemon.core.store import write_private_atomic

__all__ = ["GoodputLedger", "Loss", "JobRecord", "restart_loss"]

log = logging.getLogger(__name__)

MAX_JOBS = 1024
MAX_COMMITS = 16
MAX_REPORT_AGE = 300.0
"""A progress report older than this is refused (reports go every few seconds): it would count its
age as training time or downtime."""
MAX_STAMP_AGE = 3600.0
"""A commit's ``reached_at`` older than this is not trusted (a large save may commit minutes after
its step was reached, so the bound is looser than a report's)."""
FLUSH_SECONDS = 5.0
STATE_VERSION = 1
MAX_INTERRUPTIONS = 1_000_000
"""A job's interruptions stop counting here (a million restarts is no real job's)."""
MAX_RUNNING = 100 * 365 * 24 * 3600.0
"""A job's running seconds stop counting here (a century)."""
MAX_STEP = 2**63 - 1


@dataclass(frozen=True)
class Loss:
    """What one restart lost (see the module docstring); ``seconds`` None when unknown."""

    steps: int
    seconds: float | None
    downtime: float


@dataclass
class JobRecord:
    step: int
    """The newest step reported (or resumed from)."""
    at: float
    """When it was reached (Unix seconds)."""
    reached: dict[int, float] = field(default_factory=dict)
    """Step committed (or resumed from) in the current run -> the earliest time it is known to have
    been reached."""
    pid: int = 0
    """The process that reported last: a report from another one (a relaunch not reported as a
    restart) adds no training time. 0 for a record only commits made (another node's ranks): such a
    record is never copied to the durable store, where it would hide rank 0's."""
    interruptions: int = 0
    """Restarts of the job from a checkpoint, over all its runs known here."""
    running: float = 0.0
    """Seconds the job ran, over all its runs known here (between reports of one process)."""
    nodes: int = 1
    """Nodes the job spans, as its rank 0 reports."""
    drilled: bool = False
    """The run stopped for a drill (rank 0 reported safe for drill notices only): its restart is
    not an interruption."""
    ran: bool = True
    """The run trained: its process reported progress after it started (a run started by
    :meth:`GoodputLedger.restarted` has not until its first report). A restart after a run that
    never trained is not an interruption."""
    adopted: bool = False
    """The store's counts were added to this run's record (:meth:`GoodputLedger.adopt`): never twice."""

    def newest(self) -> int:
        """The newest step this record saw reached or committed."""
        return max([self.step, *self.reached])


class GoodputLedger:
    """Per-job progress and commit times, bounded and persisted; see the module docstring."""

    def __init__(self, path: Path | None = None, *, clock: Callable[[], float] = time.time,
                 max_jobs: int = MAX_JOBS) -> None:
        self._path, self._clock, self._max_jobs = path, clock, max_jobs
        self._jobs: OrderedDict[str, JobRecord] = OrderedDict()
        self._dirty = False
        self._written_at = float("-inf")
        self._changed: dict[str, None] = {}
        """Jobs (rank 0's) changed since :meth:`due` last handed them out, oldest change first."""
        self._handed: dict[str, float] = {}
        """Job -> when (monotonic) :meth:`due` last handed it out."""
        self._load()

    def progress(self, job: str, step: int, at: datetime, pid: int, *, not_before: float | None = None,
                 nodes: int = 1) -> float:
        """Record ``pid``'s progress report; return the training seconds since the previous report
        of the same process (0 for a first report, or one whose step went back). A report from the
        future counts as now; one older than ``MAX_REPORT_AGE``, or dated before ``not_before`` (the
        process's registration), raises ValueError."""
        now = self._clock()
        when = min(at.timestamp(), now)
        if when < now - MAX_REPORT_AGE:
            raise ValueError(f"the report is {now - when:.0f} s old, more than {MAX_REPORT_AGE:.0f} s")
        if not_before is not None and when < not_before - 1.0:  # registered_at is the daemon's clock
            raise ValueError(f"the report is dated {not_before - when:.0f} s before its process registered")
        record = self._jobs.get(job) or JobRecord(step, when, pid=pid)
        same_run = record.pid == pid and step >= record.step
        trained = max(0.0, when - record.at) if same_run else 0.0
        record.ran = record.ran or record.pid == pid
        record.step, record.at, record.pid, record.nodes = step, when, pid, nodes
        record.running = min(record.running + trained, MAX_RUNNING)
        for done, reached in record.reached.items():
            if done <= step and when < reached:
                record.reached[done] = when
        self._touch(job, record)
        return trained

    def committed(self, job: str, step: int, reached_at: datetime | None = None) -> None:
        """Record a commit of ``step``, reached at ``reached_at`` (the client's stamp: one from the
        future counts as now, one older than ``MAX_STAMP_AGE`` is not trusted) or else by its
        arrival (or the newest report, when that showed the step reached)."""
        now = self._clock()
        record = self._jobs.get(job) or JobRecord(step, now)
        stamp = None if reached_at is None else min(reached_at.timestamp(), now)
        if stamp is not None and stamp >= now - MAX_STAMP_AGE:
            record.reached[step] = stamp
        else:
            record.reached[step] = min(now, record.at) if record.step >= step else now
        while len(record.reached) > MAX_COMMITS:
            record.reached.pop(min(record.reached))
        self._touch(job, record)

    def restarted(self, job: str, resumed_from: int, pid: int) -> Loss | None:
        """Process ``pid`` restarted ``job`` from step ``resumed_from``: the loss, or None when
        nothing was known about the job. A new run of the job starts there, now."""
        now = self._clock()
        record = self._jobs.get(job)
        if record is not None and resumed_from > record.newest():
            log.info("job %r resumed from step %d, past the step %d this node last saw: it ran "
                     "elsewhere since", job, resumed_from, record.newest())
            record = None
        loss = None if record is None else restart_loss(job, record, resumed_from, now)
        history = {} if record is None else {
            "interruptions": min(record.interruptions + interrupted(record), MAX_INTERRUPTIONS),
            "running": record.running, "nodes": record.nodes, "adopted": record.adopted}
        self._touch(job, JobRecord(resumed_from, now, {resumed_from: now}, pid, ran=False, **history))
        return loss

    def adopt(self, job: str, earlier: JobRecord) -> None:
        """Add the interruptions and running time of ``earlier`` (the job's record from the store,
        read for a restart this node knew nothing of), plus that restart when ``earlier``'s run
        trained, to the job's record: once per run here (a second recall of the same run adds
        nothing)."""
        record = self._jobs.get(job)
        if record is None or record.adopted:
            return
        record.adopted = True
        record.interruptions = min(record.interruptions + earlier.interruptions + interrupted(earlier),
                                   MAX_INTERRUPTIONS)
        record.running = min(record.running + earlier.running, MAX_RUNNING)
        record.nodes = max(record.nodes, earlier.nodes)
        self._touch(job, record)

    def stopped(self, job: str, *, drill: bool) -> None:
        """Rank 0 of ``job`` stopped for notices, all of them drills when ``drill``."""
        record = self._jobs.get(job)
        if record is not None and record.drilled != drill:
            record.drilled = drill
            self._dirty = True

    def record(self, job: str) -> JobRecord | None:
        """The job's record (the ledger's own: do not change it), or None."""
        return self._jobs.get(job)

    def recent(self, count: int) -> list[tuple[str, JobRecord]]:
        """The ``count`` most recently updated jobs' records, newest first."""
        out = []
        for job in reversed(self._jobs):
            if len(out) >= count:
                break
            out.append((job, self._jobs[job]))
        return out

    def due(self, interval: float, held: set[str] | frozenset[str] = frozenset()
            ) -> list[tuple[str, JobRecord]]:
        """Copies of rank 0's records changed since last handed out at least ``interval`` seconds
        ago (each job's first change at once), for :mod:`.goodput_store`; they count as handed out.
        Jobs in ``held`` stay changed, for later."""
        now, out = time.monotonic(), []
        for job in list(self._changed):
            if job not in held and now - self._handed.get(job, float("-inf")) >= interval:
                del self._changed[job]
                self._handed[job] = now
                record = self._jobs[job]
                out.append((job, replace(record, reached=dict(record.reached))))
        return out

    def _touch(self, job: str, record: JobRecord) -> None:
        self._jobs[job] = record
        self._jobs.move_to_end(job)
        if record.pid:
            self._changed[job] = None
        while len(self._jobs) > self._max_jobs:
            gone, _ = self._jobs.popitem(last=False)
            self._changed.pop(gone, None)
            self._handed.pop(gone, None)
        self._dirty = True

    # ------------------------------------------------------------------ persistence

    def flush(self, *, force: bool = False) -> None:
        """Write the state file if something changed and ``FLUSH_SECONDS`` passed (or ``force``)."""
        now = time.monotonic()
        if self._path is None or not self._dirty or (not force and now - self._written_at < FLUSH_SECONDS):
            return
        self._dirty, self._written_at = False, now
        doc = {"version": STATE_VERSION, "jobs": [
            {"job": job, "step": r.step, "at": r.at, "reached": sorted(r.reached.items()), "pid": r.pid,
             "interruptions": r.interruptions, "running": r.running, "nodes": r.nodes, "drilled": r.drilled,
             "ran": r.ran, "adopted": r.adopted}
            for job, r in self._jobs.items()]}
        try:
            write_private_atomic(self._path, json.dumps(doc).encode())
        except OSError as exc:
            log.error("cannot write %s: %s (goodput figures will not survive a restart)", self._path, exc)

    def _load(self) -> None:
        if self._path is None or not self._path.exists():
            return
        try:
            doc = json.loads(self._path.read_bytes())
            if doc.get("version") != STATE_VERSION:
                raise ValueError(f"version {doc.get('version')!r}, not {STATE_VERSION}")
            items = doc["jobs"][-self._max_jobs:]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable goodput state %s: %s", self._path, str(exc)[:200])
            return
        bad = 0
        for item in items:
            try:
                self._jobs[str(item["job"])[:256]] = _record_of(item)
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
                if not bad:
                    log.warning("ignoring a job of the goodput state %s: %s", self._path, str(exc)[:200])
                bad += 1
        if bad > 1:
            log.warning("ignored %d jobs of the goodput state %s in all", bad, self._path)


def interrupted(record: JobRecord) -> int:
    """1 when a restart after ``record``'s run is an interruption (the run trained, and did not stop
    for drill notices only), else 0."""
    return int(record.ran and not record.drilled)


def _record_of(item: dict) -> JobRecord:
    """One job's record from the state file, every figure checked against its bounds (ValueError)."""
    reached = {_bounded(s, 0, MAX_STEP): _seconds(t) for s, t in item["reached"][-MAX_COMMITS:]}
    return JobRecord(_bounded(item["step"], 0, MAX_STEP), _seconds(item["at"]), reached,
                     _bounded(item.get("pid", 0), 0, 2**32),
                     _bounded(item.get("interruptions", 0), 0, MAX_INTERRUPTIONS),
                     min(_seconds(item.get("running", 0.0)), MAX_RUNNING),
                     _bounded(item.get("nodes", 1), 1, 2**20), item.get("drilled") is True,
                     item.get("ran", True) is not False, item.get("adopted") is True)


def _bounded(value: object, low: int, high: int) -> int:
    """An int from the state file within [low, high], else ValueError."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{str(value)[:32]!r} is not a whole number from {low} to {high}")
    return value


def _seconds(value: object) -> float:
    """A finite number of seconds >= 0 from the state file, else ValueError."""
    number = float(value)  # type: ignore[arg-type]
    if not (number >= 0 and number != float("inf")):
        raise ValueError(f"{value!r} is not a number of seconds")
    return number


def restart_loss(job: str, record: JobRecord, resumed_from: int, now: float) -> Loss:
    """What a restart of ``job`` from ``resumed_from`` at ``now`` lost of ``record``'s run (see the
    module docstring), logged."""
    last_commit = max([resumed_from, *record.reached])
    steps = max(0, record.step - last_commit)
    start = record.reached.get(last_commit)
    seconds = 0.0 if steps == 0 else None if start is None else max(0.0, record.at - start)
    loss = Loss(steps, seconds, max(0.0, now - record.at))
    log.info("job %r restarted from step %d: %d steps (%s s) lost after its last commit, %.1f s down",
             job, resumed_from, loss.steps, "unknown" if loss.seconds is None else f"{loss.seconds:.1f}",
             loss.downtime)
    return loss
