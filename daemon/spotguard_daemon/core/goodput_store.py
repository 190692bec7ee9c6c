"""The goodput ledger's copy in the durable store, so that a restart on a fresh node counts its loss.

A spot node's daemon dies with the node, and with it what it knew of the job's progress; the job is
relaunched on another node and restores its checkpoint from the durable store. So the daemon keeps,
next to each job's checkpoints, a small object ``jobs/<job>/progress.json``
(:func:`~spotguard.storage.durable.progress_key`): rank 0's newest reported step and when it was
reached, the steps committed in that run and when, and the job's interruptions and running time over
all its runs (:class:`ProgressObject`; no paths, no pids, nothing secret). When a rank-0 process
registers as resumed from step R and this node knows nothing of the job (or only an older part of
it: see :meth:`.GoodputLedger.restarted`), the object is read and the restart's loss counted from
it, as the node that ran the job would have (under the tier the restart's register named:
:mod:`.metrics`); its interruptions and running time go on in this node's record
(:meth:`.GoodputLedger.adopt`, on the daemon's loop at the next :meth:`DurableProgress.tick`), so
the job's learned MTBF (:mod:`.job_rates`) follows it. Until then (at most ``RECALL_HOLD``) the new
run's record is not written over the old one.

* **Bounded rate.** A job's object is written at its first change, then at most every
  ``storage.progress_seconds`` (30 s by default) and only when it changed; while a terminating notice
  is pending, at most every ``URGENT_SECONDS``; at the daemon's stop, once more for what changed.
* **Bounded count.** At most ``MAX_STORE_JOBS`` distinct jobs' objects are written per
  ``STORE_JOBS_WINDOW`` (an hour): a node runs a few jobs, and progress for made-up job ids (only
  proven ``ipc://`` peers may report any, see :mod:`.handlers`) must not fill the bucket. A job
  beyond the cap is not copied, with one warning per window.
* **Out of the way of checkpoints.** Writes and reads run on a thread of their own (niced like the
  upload worker) that shares the store's client, never on the upload worker: a slow or unreachable
  store delays only these small requests, never a checkpoint upload nor the notice loop. A failed
  write is tried again an interval later unless a newer one replaced it.
* **Untrusted on read.** The object is read at most ``MAX_BYTES``, parsed and validated by pydantic,
  and must name the job, hold finite times no later than the registration (a record written since
  is the new run's; node clocks are assumed to agree within the downtime, as NTP keeps them) and
  no older than ``MAX_AGE``; anything else is ignored with one warning, and the restart counts no
  loss.
* **Versions.** A mixed fleet (nodes upgraded one by one) reads each other's objects. Fields are
  only ever added, and a daemon that adds one raises ``version``: an object of a newer version is
  read for the fields this daemon knows, the others dropped (said once per read); an object of
  this version (or older) with a field it does not know is not one of ours and is ignored, as
  above. Nothing is lost either way: anyone who can write the object can write a valid one.

Residual limits: progress made after the object was last written is not counted, so a node killed
without notice loses up to ``progress_seconds`` of the figures (plus the client's report interval,
5 s by default); with a notice the object is current within about a second. A restart counts no
loss when the store cannot be read. Only rank 0's daemon writes (see ``JobRecord.pid``).

Exceptions: none escape; store errors are logged, once per run of failures.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Annotated, Callable, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from spotguard._priority import lower_priority
from spotguard.storage.base import IntegrityError, NotFound, Store, StoreError
from spotguard.storage.durable import progress_key
from spotguard.storage.file import make_private_dirs

from spotguard_daemon.core.goodput import (MAX_COMMITS, MAX_INTERRUPTIONS, MAX_RUNNING, GoodputLedger, JobRecord,
                                           restart_loss)
from spotguard_daemon.core.metrics import Metrics

__all__ = ["DurableProgress", "NoProgress", "ProgressObject"]

log = logging.getLogger(__name__)

URGENT_SECONDS = 1.0
RECALL_HOLD = 30.0
MAX_BYTES = 16 * 1024
MAX_AGE = 30 * 24 * 3600.0
"""An object older than this at a restart is ignored (its age would count as downtime)."""
MAX_RECALLS = 256
MAX_STORE_JOBS = 32
STORE_JOBS_WINDOW = 3600.0
_Step = Annotated[int, Field(ge=0, lt=2**63)]
VERSION = 2
"""This daemon's version of the object (:class:`ProgressObject`); raised with every field added
(2: ``ran``)."""


class ProgressObject(BaseModel):
    """The object's schema (JSON); see the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    version: Literal[1, 2] = VERSION
    job: str = Field(max_length=256)
    step: _Step
    """The newest step rank 0 reported (or resumed from)."""
    at: float = Field(gt=0)
    """When it was reached (Unix seconds)."""
    reached: list[tuple[_Step, float]] = Field(default=[], max_length=MAX_COMMITS)
    """[step, time first known reached] of the steps committed (or resumed from) in that run."""
    written: float = Field(gt=0)
    interruptions: int = Field(default=0, ge=0, le=MAX_INTERRUPTIONS)
    """Restarts of the job over all its runs (absent in objects of older daemons)."""
    running: float = Field(default=0.0, ge=0, le=MAX_RUNNING)
    """Seconds the job ran over all its runs."""
    nodes: int = Field(default=1, ge=1, le=2**20)
    ran: bool = True
    """The run trained (see ``JobRecord.ran``); version 2 on (older objects: assumed)."""

    def record(self) -> JobRecord:
        return JobRecord(self.step, self.at, dict(self.reached), interruptions=self.interruptions,
                         running=self.running, nodes=self.nodes, ran=self.ran)


class DurableProgress:
    """Writes the ledger's due records to ``store`` and reads them back at restarts; see the module.

    :meth:`tick` and :meth:`recall` are called on the daemon's loop and only queue work."""

    def __init__(self, store: Store, ledger: GoodputLedger, metrics: Metrics, *, scratch: Path,
                 interval: float = 30.0, nice: int = 19, urgent: Callable[[], bool] = lambda: False) -> None:
        self.store, self.ledger, self.metrics = store, ledger, metrics
        self.scratch, self.interval, self.nice, self.urgent = scratch, interval, nice, urgent
        self._cond = threading.Condition()
        self._writes: dict[str, bytes] = {}
        self._failed: dict[str, tuple[bytes, float]] = {}
        self._recalls: deque[tuple[str, int, float, str | None]] = deque(maxlen=MAX_RECALLS)
        self._recalled: deque[tuple[str, JobRecord | None]] = deque(maxlen=MAX_RECALLS)
        """Records read for restarts (None: none read), for :meth:`tick` to hand to the ledger on the
        daemon's loop."""
        self._recalling: dict[str, float] = {}
        """Job -> when (monotonic) its recall was queued: its new record is not written before the
        old one's counts are adopted (else a node lost meanwhile would leave a count of 0 behind),
        for at most ``RECALL_HOLD`` seconds."""
        self._stored: dict[str, float] = {}
        """Job -> when (monotonic) its object was last queued; at most MAX_STORE_JOBS in a window."""
        self._capped_at = float("-inf")
        self._failing = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spotguard-progress", daemon=True)
        self._thread.start()

    def tick(self, *, force: bool = False) -> None:
        """Queue the records due (every change when ``force``) and the failed writes to try again."""
        now = time.monotonic()
        while self._recalled:
            job, record = self._recalled.popleft()
            self._recalling.pop(job, None)
            if record is not None:
                self.ledger.adopt(job, record)
        for job in [j for j, at in self._recalling.items() if force or at < now - RECALL_HOLD]:
            del self._recalling[job]
        interval = 0.0 if force else URGENT_SECONDS if self.urgent() else self.interval
        due = self.ledger.due(interval, held=set(self._recalling))
        with self._cond:
            for job, record in due:
                if not self._admit(job, now):
                    continue
                try:
                    self._writes[job] = _encode(job, record)
                except ValueError as exc:  # a record the schema refuses is not written, never fatal
                    log.error("not writing the progress of job %r to the store: %s", job[:64], exc)
                    continue
                self._failed.pop(job, None)
            for job, (body, retry_at) in list(self._failed.items()):
                if force or retry_at <= now:
                    self._writes.setdefault(job, body)
                    del self._failed[job]
            if self._writes:
                self._cond.notify()

    def _admit(self, job: str, now: float) -> bool:
        """Whether ``job``'s object may be written: it was within the window, or the window has
        room for one more job; lock held."""
        for old in [j for j, at in self._stored.items() if at < now - STORE_JOBS_WINDOW]:
            del self._stored[old]
        if job not in self._stored and len(self._stored) >= MAX_STORE_JOBS:
            if now - self._capped_at >= STORE_JOBS_WINDOW:
                self._capped_at = now
                log.warning("not copying the progress of job %r to %s: %d jobs were copied in the last "
                            "%.0f s, the most allowed (further jobs are skipped silently for that long)",
                            job[:64], self.store.url, MAX_STORE_JOBS, STORE_JOBS_WINDOW)
            return False
        self._stored[job] = now
        return True

    def recall(self, job: str, resumed_from: int, tier: str | None = None) -> None:
        """Rank 0 of ``job``, unknown here, registered now as resumed from ``resumed_from`` (a
        checkpoint from ``tier``; None: not said): read the job's object and count the loss under
        that tier (asynchronously)."""
        if len(self._recalling) < MAX_RECALLS:
            self._recalling[job] = time.monotonic()
        with self._cond:
            self._recalls.append((job, resumed_from, time.time(), tier))
            self._cond.notify()

    def close(self, timeout: float = 2.0) -> None:
        """Queue what changed, then let the thread write it for up to ``timeout`` seconds."""
        self.tick(force=True)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        lower_priority(self.nice)
        while True:
            with self._cond:
                while not (self._recalls or self._writes or self._stop):
                    self._cond.wait()
                if self._recalls:  # before any write: a write could be the new run's record
                    task: Callable[[], None] = self._recall_task(*self._recalls.popleft())
                elif self._writes:
                    job = next(iter(self._writes))
                    task = self._write_task(job, self._writes.pop(job))
                else:
                    return
            try:
                task()
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the figures' thread
                log.error("goodput store task failed: %r", exc, exc_info=exc)

    def _write_task(self, job: str, body: bytes) -> Callable[[], None]:
        def write() -> None:
            try:
                self.store.put_bytes(progress_key(job), body)
            except ValueError:  # a job id the store cannot name: its checkpoints are refused too
                return
            except StoreError as exc:
                if not self._failing:
                    log.warning("cannot write the progress of job %r to %s: %s (trying again; a fresh "
                                "node will count less of the next restart's loss)", job, self.store.url, exc)
                self._failing = True
                with self._cond:
                    self._failed[job] = (body, time.monotonic() + self.interval)
                return
            if self._failing:
                log.info("progress writes to %s work again", self.store.url)
            self._failing = False
        return write

    def _recall_task(self, job: str, resumed_from: int, at: float, tier: str | None) -> Callable[[], None]:
        def recall() -> None:
            record = self._read(job, at)
            self._recalled.append((job, record))
            if record is None:
                return
            self.metrics.lost(restart_loss(job, record, resumed_from, at), tier)
            self.metrics.redone(max(record.reached, default=-1) - resumed_from, tier)
        return recall

    def _read(self, job: str, before: float) -> JobRecord | None:
        """The job's record from the store, valid and older than ``before``; None (logged) otherwise."""
        try:
            key = progress_key(job)
        except ValueError:
            return None
        try:
            body = self._get(key)
        except NotFound:
            log.info("job %r has no progress record in %s: its restart counts no loss", job, self.store.url)
            return None
        except (StoreError, OSError) as exc:
            log.warning("cannot read the progress of job %r from %s: %s; its restart counts no loss",
                        job, self.store.url, exc)
            return None
        try:
            return _validated(body, job, before)
        except ValueError as exc:
            log.warning("ignoring the progress record of job %r in %s: %s", job, self.store.url, _short(exc))
            return None

    def _get(self, key: str) -> bytes:
        """The object's bytes, at most ``MAX_BYTES`` (its size is checked before the download)."""
        make_private_dirs(self.scratch)
        fd, name = tempfile.mkstemp(prefix=".progress-", dir=self.scratch)
        os.close(fd)
        try:
            self.store.get_file(key, Path(name), max_size=MAX_BYTES)
            with open(name, "rb") as handle:
                body = handle.read(MAX_BYTES + 1)
        finally:
            os.unlink(name)
        if len(body) > MAX_BYTES:
            raise IntegrityError(f"{key} is over {MAX_BYTES} bytes")
        return body


class NoProgress:
    """:class:`DurableProgress` for a daemon without a durable store (``storage.url = "none"``):
    nothing is written; a restart that only the store could tell about counts no loss."""

    def start(self) -> None:
        pass

    def tick(self, *, force: bool = False) -> None:
        pass

    def recall(self, job: str, resumed_from: int, tier: str | None = None) -> None:
        log.info("job %r is unknown here and there is no durable store: its restart counts no loss",
                 job)

    def close(self, timeout: float = 2.0) -> None:
        pass


def _encode(job: str, record: JobRecord) -> bytes:
    return ProgressObject(job=job, step=record.step, at=record.at, reached=sorted(record.reached.items()),
                          written=time.time(), interruptions=record.interruptions,
                          running=min(record.running, MAX_RUNNING), nodes=record.nodes,
                          ran=record.ran).model_dump_json().encode()


def _validated(body: bytes, job: str, before: float) -> JobRecord:
    """The record ``body`` holds; ValueError unless it is the job's and its times are plausible."""
    try:
        doc = ProgressObject.model_validate_json(body)
    except ValidationError:
        known = _known_fields_of_newer(body)
        if known is None:
            raise
        doc = ProgressObject.model_validate(known)
    if doc.job != job:
        raise ValueError(f"it names job {doc.job[:64]!r}")
    for when in [doc.written, doc.at, *(t for _, t in doc.reached)]:
        if not before - MAX_AGE <= when <= before:
            raise ValueError(f"time {when:.0f} is not within the {MAX_AGE:.0f} s before the restart")
    return doc.record()


def _known_fields_of_newer(body: bytes) -> dict | None:
    """The fields this daemon knows of an object of a newer version (a newer daemon's), or None
    when ``body`` is not such an object."""
    try:
        raw = pydantic_core.from_json(body)
    except ValueError:
        return None
    version = raw.get("version") if isinstance(raw, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version <= VERSION:
        return None
    dropped = sorted(k for k in raw if k not in ProgressObject.model_fields)
    log.info("progress object of version %d (this daemon reads %d): using the fields it knows%s", version,
             VERSION, f", not {', '.join(k[:32] for k in dropped[:8])}" if dropped else "")
    return {k: v for k, v in raw.items() if k in ProgressObject.model_fields and k != "version"}


def _short(exc: ValueError) -> str:
    """One line without the offending input (it came from the bucket)."""
    if isinstance(exc, ValidationError):
        first = exc.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(part)[:32] for part in first["loc"])
        return f"{exc.error_count()} validation error(s), first at {where or 'top'!r}: {first['msg'][:120]}"
    return str(exc)[:200]
