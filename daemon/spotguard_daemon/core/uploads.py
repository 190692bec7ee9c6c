"""The upload queue: makes committed checkpoints durable in the background, journaled on disk.

::

    commit request --submit()--> journal (uploads.json) --worker thread--> Durable.upload (Flight)
                                                   --> on_durable(job, step) --> Retention.run

* **One job, one checkpoint in flight, newest first.** A newer commit of a job supersedes an older
  one still queued, and abandons one uploading unless ``finish_superseded``; while a notice is
  pending (``urgent``), another job's newer commit pre-empts the upload in flight, which is queued
  again and resumes, reusing the objects already sent (:mod:`.upload_flight`: the hooks that pace
  and abandon an upload). A superseded upload is finished all the same once the lag behind the
  global step passed its bound, and incomplete node-local steps are checked again while idle
  (:mod:`.upload_global`); with node-local roots the nodes converge on node 0's proposed step
  (:mod:`.upload_fleet`). Uploads and retention (:mod:`.upload_retention`) of one prefix run one
  at a time, as :mod:`spotguard.storage.durable` requires; a node-local job's retention is node 0's.
* **Journaled.** Every accepted commit is written to ``<state_dir>/uploads.json`` (atomically) before
  the request is answered and removed only once durable, so a daemon killed mid-upload resumes on
  restart; content addressing means objects already in the bucket are not sent again. A journal
  that cannot be written (full disk) is retried while uploads go on from memory
  (:mod:`.upload_journal`), and on start :meth:`UploadQueue.reconcile` queues every job's committed
  checkpoint under ``root`` that is newer than its durable one.
* **Confined.** Files are read only through :func:`.confine.staged`; a checkpoint that fails its
  checks is refused for good (``refused`` in status), never retried, never blocking another.
* **Background.** The worker thread lowers its CPU priority (``storage.upload_nice``, default 19)
  before it starts; the file pool and the SDKs' transfer threads it creates inherit that niceness
  (Linux niceness is per thread), so hashing and sending a checkpoint yields to a training
  process on the same cores while the daemon's notice loop keeps its normal priority. On 2 cores
  (benchmarks/bench_upload.py, 1 GB) a one-thread training loop slowed by several times at nice 0
  (eight runnable hashing/copy threads), by more than 10 % at nice 10, and by less at nice 19. The
  price: on cores saturated by training an upload progresses slowly, until a notice stops it.
* **Bounded.** File-level concurrency is the store's (``storage.concurrency``), bandwidth is capped
  inside a file (:mod:`.upload_flight`); transient store errors are retried with exponential
  backoff, forever but never slower than ``retry_max`` seconds apart, because a checkpoint that is
  not durable yet is exactly what must not be dropped; a failed upload waits without holding up
  other jobs'.

Without a store (``storage.url = "none"``) :func:`from_settings` gives a
:class:`~.no_store.NoStoreQueue` instead: same interface, commits accepted and not copied, never a
``durable`` event.

Exceptions: none escape the worker; failures are logged once per attempt and retried, and an error
that escapes anyway restarts the worker (``spotguard_upload_worker_restarts_total``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from prometheus_client import CollectorRegistry
from spotguard._priority import lower_priority
from spotguard.storage._local import ManifestError, step_name
from spotguard.storage.base import IntegrityError, Store, StoreOptions
from spotguard.storage.registry import open_store
from spotguard.storage.durable import GC_GRACE_SECONDS, Durable, DurableInfo, manifest_key
from spotguard.storage.fresh_node import DEFAULT_JOB

from spotguard_daemon.core import confine
from spotguard_daemon.core.no_store import NoStoreQueue
from spotguard_daemon.core.upload_fleet import Fleet
from spotguard_daemon.core.upload_flight import Flight, Preempted, Superseded
from spotguard_daemon.core.upload_global import GlobalWatch
from spotguard_daemon.core.upload_journal import Journal, Upload, UploadMetrics
from spotguard_daemon.core.upload_pins import Pins
from spotguard_daemon.core.upload_retention import Retention, backoff
from spotguard_daemon.core.redact import redact_url

__all__ = ["UploadQueue", "NoStoreQueue", "Upload", "from_settings"]

log = logging.getLogger(__name__)

JOURNAL_RETRY_SECONDS = 2.0
INTEGRITY_ATTEMPTS = 3
"""A checkpoint whose files disagree with its manifest this many times in a row is refused."""


class _Learned(Exception):
    """This daemon's first upload of a job showed that another node leads it (:meth:`.Fleet.learn`):
    nothing is sent yet, and the upload is chosen again as a follower's (:meth:`UploadQueue._proposed`
    reads node 0's proposal only for a job known to follow)."""


class UploadQueue:
    """Serialises uploads of committed checkpoints to one :class:`Durable` store.

    ``root`` confines what may be read (:mod:`.confine`; default: each checkpoint's parent);
    ``staging`` is where the confined views live (default: next to the journal)."""

    def __init__(self, durable: Durable, journal: Path, *, keep: int = 3,
                 finish_superseded: bool = False, bandwidth_mbps: float | None = None, nice: int = 19,
                 on_durable: Callable[[str, int, str], None] | None = None,
                 registry: CollectorRegistry | None = None, retry_max: float = 30.0,
                 url: str = "", root: Path | None = None, staging: Path | None = None,
                 urgent: Callable[[], bool] = lambda: False, lag_bound: float = 600.0,
                 max_superseded: int = 3) -> None:
        self.durable, self.keep = durable, keep
        self.url = redact_url(url.split("?", 1)[0])
        """Where checkpoints go, as clients may restore from it (a query string or a password masked)."""
        self.root, self.staging = root, staging or journal.parent / "upload-staging"
        self.finish_superseded, self.retry_max, self.urgent = finish_superseded, retry_max, urgent
        self.bytes_per_second = bandwidth_mbps * 1e6 if bandwidth_mbps else None
        self.nice = nice
        self.on_durable = on_durable or (lambda job, step, key: None)
        self.metrics = UploadMetrics(registry)
        self.metrics.durable_age.set_function(self._age)
        self.watch = GlobalWatch(lag_bound, max_superseded)
        """Global steps, the lag behind them, and incomplete steps to check again (:mod:`.upload_global`)."""
        self.metrics.global_lag.set_function(self.watch.lag)
        self.fleet = Fleet(lag_bound)
        """Node-local roots: node 0 proposes the step the other nodes upload next (:mod:`.upload_fleet`)."""
        self.pins = Pins(root, self.staging)
        """The proposed step, held open from its commit until uploaded (:mod:`.upload_pins`)."""
        self._cond = threading.Condition()
        self._queue: dict[str, Upload] = {}
        self._current: Upload | None = None
        self._progress = (0, 0)
        self._durable: dict[str, dict[str, Any]] = {}
        self._refused: dict[str, dict[str, Any]] = {}
        self.retention = Retention(lambda job: self.durable.prune(job, self.keep, grace=GC_GRACE_SECONDS),
                                   min(retry_max, 5.0))
        self._restarts = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.journal = Journal(journal, self.metrics.journal_errors)
        self._queue, self._durable = self.journal.load()
        for upload in self._queue.values():
            self.watch.submitted(upload.job_id, upload.step)
        self.metrics.depth.set(len(self._queue))
        self._restore_durable_step()

    # ------------------------------------------------------------------ public

    @property
    def store(self) -> Store:
        """The store checkpoints go to (the daemon checks it at start-up and shares its client)."""
        return self.durable.store

    def start(self) -> None:
        """Start the worker; it first queues what was committed while no daemon ran (:meth:`reconcile`)."""
        shutil.rmtree(self.staging, ignore_errors=True)  # a killed daemon's views: dangling links
        with self._cond:
            self._spawn(reconcile=True)

    def submit(self, job_id: str, path: Path, step: int, size_bytes: int = 0) -> None:
        """Queue ``path`` (a committed checkpoint directory) for upload, journaled when the state
        directory allows (a journal write that fails is retried; the commit is uploaded from memory).

        A commit without a job id belongs to the job ``default``, as for the client's restore."""
        job_id = job_id or DEFAULT_JOB
        if self.fleet.submitted(job_id, step):  # the step node 0 proposed ahead of the commits
            self.pins.pin(job_id, Path(path), step)
        with self._cond:
            if not self._enqueue(Upload(job_id, str(path), step, size_bytes)):
                return
            self.watch.submitted(job_id, step)
            self._save_journal()
            self._cond.notify_all()
            self._ensure_worker()
        log.info("queued %s step %d for upload", job_id, step)

    def durable_step(self, job_id: str) -> int | None:
        with self._cond:
            return self._durable.get(job_id, {}).get("step")

    def time_to_durable(self, job_id: str) -> float | None:
        """Median seconds from commit to durable of the job's last uploads (:mod:`.upload_global`)."""
        return self.watch.time_to_durable(job_id or DEFAULT_JOB)

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and self._current is None

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is queued or uploading, or ``timeout`` seconds; True when idle."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._current is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def status(self) -> dict[str, Any]:
        with self._cond:
            self._ensure_worker()
            pending = [_shown(u) for u in self._queue.values()]
            current = _shown(self._current) if self._current else None
            done, total = self._progress
            alive = self._thread is not None and self._thread.is_alive()
            return {"store": self.url, "disabled": False, "pending": pending,
                    "uploading": current, "bytes_pending": sum(u["size_bytes"] for u in pending) + (total - done),
                    "durable": {job: dict(d) for job, d in self._durable.items()},
                    "refused": {job: dict(r) for job, r in self._refused.items()},
                    "retention_retry": self.retention.status(),
                    "worker": {"alive": alive, "restarts": self._restarts}, "global": self.watch.status(),
                    "journal_ok": self.journal.ok}

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.pins.close()

    # ------------------------------------------------------------------ worker life

    def _spawn(self, reconcile: bool = False) -> None:
        self._thread = threading.Thread(target=self._run, args=(reconcile,), name="spotguard-uploads",
                                        daemon=True)
        self._thread.start()

    def _ensure_worker(self) -> None:
        """Restart a worker thread that is gone (it should never be); called with the lock held."""
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            log.error("the upload worker had stopped; restarting it")
            self._restarted()
            self._spawn()

    def _restarted(self) -> None:
        self._restarts += 1
        self.metrics.restarts.inc()
        if self._current is not None:
            self._enqueue(self._current)
            self._current = None

    def _run(self, reconcile: bool) -> None:
        """The thread: never ends before :meth:`close`, whatever an upload or a store raises."""
        lower_priority(self.nice)  # before any pool thread exists: they inherit it
        if reconcile:
            self._guarded(self.reconcile)
        while not self._guarded(self._work):
            time.sleep(1.0)

    def _guarded(self, step: Callable[[], None]) -> bool:
        try:
            step()
            return True
        except BaseException as exc:  # noqa: BLE001 - the worker must outlive every bug below it
            log.critical("upload worker failed (%r); restarting it", exc, exc_info=exc)
            with self._cond:
                self._restarted()
            return False

    def reconcile(self) -> None:
        """Queue each job's committed checkpoint under ``root`` that is newer than its durable one:
        it was committed while no daemon listened (down, restarting) or its journal entry was lost."""
        if self.root is None:
            return
        for job_id, step, path in confine.committed(self.root):
            with self._cond:
                known = max(self._durable.get(job_id, {}).get("step", -1),
                            self._queue[job_id].step if job_id in self._queue else -1)
            if step > known and step > self._store_latest(job_id):
                log.info("found %s step %d committed but not durable; queueing it", job_id, step)
                self.submit(job_id, path, step)

    def _store_latest(self, job_id: str) -> int:
        try:
            latest = self.durable.latest(job_id)
        except Exception as exc:  # noqa: BLE001 - unreachable store: upload, objects are deduplicated
            log.info("cannot read durable latest of %s (%s); uploading its local checkpoint", job_id, exc)
            return -1
        return -1 if latest is None else latest

    # ------------------------------------------------------------------ worker

    def _work(self) -> None:
        """Upload the next commit; when none is ready, retry a failed retention (never while a
        notice is pending: a delete must not hold up the upload that matters)."""
        while True:
            with self._cond:
                upload, prune, recheck = self._next(), None, None
                while upload is None and prune is None and recheck is None and not self._stop:
                    prune, recheck = self._retention_ready(), self.watch.due()
                    if prune is None and recheck is None:
                        self._cond.wait(self._wait_time())
                        self._retry_journal()
                        upload = self._next()
                if self._stop:
                    return
            if upload is not None:
                self._attempt(upload)
            elif recheck is not None:
                self.watch.recheck(self.durable, *recheck)
            else:
                self.retention.run(prune)

    def _enqueue(self, upload: Upload) -> bool:
        """Queue ``upload`` unless a newer one of its job is queued or durable, or uploading now: a
        node's ranks each report the same commit (one upload per node per step), and a late report
        of an older step must not abandon the newer one in flight. Lock held."""
        queued = self._queue.get(upload.job_id)
        done = self._durable.get(upload.job_id, {}).get("step", -1)
        if (queued is not None and queued.step >= upload.step) or upload.step <= done:
            return False
        current = self._current
        if current is not None and current is not upload and current.job_id == upload.job_id and (
                current.step > upload.step or (current.step == upload.step and current.path == upload.path)):
            return False
        self._queue[upload.job_id] = upload
        self.metrics.depth.set(len(self._queue) + (self._current is not None))
        return True

    def _next(self) -> Upload | None:
        """The newest commit across jobs whose retry delay is over goes first (on a termination
        notice it is the one that matters); a failing one never holds up the others. Lock held."""
        now = time.time()
        ready = [j for j, u in self._queue.items() if u.not_before <= now]
        if not ready:
            return None
        job = max(ready, key=lambda j: self._queue[j].submitted)
        self._current = self._queue.pop(job)
        self._progress = (0, 0)
        return self._current

    def _retention_ready(self) -> str | None:
        """A job whose failed retention is due again, unless a notice is pending."""
        job = self.retention.ready()
        return job if job is not None and not self._urgent() else None

    def _wait_time(self) -> float | None:
        waits = [u.not_before - time.time() for u in self._queue.values()]
        waits += self.retention.waits() + self.watch.waits()
        if self.journal.dirty:
            waits.append(JOURNAL_RETRY_SECONDS)
        return max(0.05, min(waits)) if waits else None

    def _attempt(self, upload: Upload) -> None:
        upload.attempts += 1
        knew = self.fleet.coordinated(upload.job_id)  # its node index learned from an earlier upload
        upload = self._proposed(upload)
        flight = Flight(self._cond, lambda: self._why_abandon(upload), self._set_progress,
                        self.bytes_per_second)
        try:
            _check_job(upload.job_id)
            view = self.pins.view(upload.job_id, upload.step)  # held open since its commit
            with contextlib.nullcontext(view) if view is not None else confine.staged(
                    self.root or Path(upload.path).parent, Path(upload.path), upload.step, self.staging) as ckpt:
                self.fleet.learn(upload.job_id, ckpt)
                if not knew and self.fleet.follows(upload.job_id):
                    raise _Learned  # a follower's first upload: choose again, with node 0's proposal
                self._lead(upload)
                info = self._send(upload, ckpt, flight)
        except Superseded:
            log.info("upload of %s step %d superseded by a newer checkpoint", upload.job_id, upload.step)
            self.watch.superseded(upload.job_id)
            self._finish(upload, None)
        except _Learned:
            upload.attempts -= 1
            self._put_back(upload)
        except Preempted:
            log.info("upload of %s step %d paused for a newer checkpoint (notice pending)",
                     upload.job_id, upload.step)
            self._put_back(upload)
        except (confine.UnsafeCheckpoint, ManifestError) as exc:
            if self._deleted_for_newer(upload):
                log.info("upload of %s step %d superseded: the job deleted it (its retention) for a newer "
                         "checkpoint before the upload began", upload.job_id, upload.step)
                self.watch.superseded(upload.job_id)
                self._finish(upload, None)
            else:
                self._refuse(upload, exc)
        except IntegrityError as exc:  # files changed since the commit, or a corrupt transfer
            self._refuse(upload, exc) if upload.attempts >= INTEGRITY_ATTEMPTS else self._failed(upload, exc)
        except Exception as exc:  # noqa: BLE001 - any SDK's transport error: retry, never die
            self._failed(upload, exc)
        else:
            self.metrics.bytes.inc(info.bytes_uploaded)
            self.metrics.seconds.observe(info.seconds)
            with self._cond:
                overtaken = upload.job_id in self._queue
            self.watch.uploaded(upload.job_id, info.step, info.complete, upload.submitted, overtaken)
            self._finish(upload, info)  # the pointer is written: durable now, published before any delete
            self.fleet.uploaded(self.durable, upload.job_id, info.step, upload.path, info.complete, info.seconds)
            self.pins.release(upload.job_id, info.step)
            self.durable.cleanup(info)  # a slow or stalled delete delays nothing a client waits for
            if not self.fleet.follows(upload.job_id):  # node-local roots: node 0 prunes for the fleet
                self.retention.run(upload.job_id)

    def _put_back(self, upload: Upload) -> None:
        """Queue ``upload`` again, no longer in flight (dropped if a newer commit of its job is queued)."""
        with self._cond:
            self._current = None
            self._enqueue(upload)

    def _lead(self, upload: Upload) -> None:
        """Node 0 of a job behind its saves (:meth:`.GlobalWatch.finish`), when no open proposal
        stays: propose the step it starts uploading and finish it although superseded; or, when
        this start comes late after that step's commit, a commit ahead, held here from its commit
        as on the other nodes (:mod:`.upload_fleet`, :mod:`.upload_pins`)."""
        job = upload.job_id
        if not self.fleet.leads(job) or self.fleet.finishes(job, upload.step) or self.watch.finish(job) is None:
            return
        step = self.fleet.propose(self.durable, job, upload.step, upload.path,
                                  "node 0 finishes its part as the others will", ahead=True)
        if step == upload.step:
            self.watch.finish_anyway(job, step, starting=True)
            self.fleet.finish(job, step)
        elif step is not None and (committed := self.fleet.expect(job, step)) is not None:
            # committed during the proposal's write: held from now on (else from its commit, as
            # on the other nodes)
            self.pins.pin(job, Path(upload.path).parent / step_name(committed), committed)

    def _send(self, upload: Upload, ckpt: Path, flight: Flight) -> DurableInfo:
        """:meth:`Durable.upload`; a follower's upload superseded goes on when node 0 proposed its
        step meanwhile (the objects sent are reused), before the job's retention can delete it."""
        while True:  # adopt() says yes once per step: the step is then followed, never superseded
            try:
                return self.durable.upload(ckpt, upload.job_id, progress=flight.progress,
                                           interrupt=flight.interrupt, cleanup=False)
            except Superseded:
                if not self.fleet.adopt(self.durable.store, upload.job_id, upload.step,
                                        self.watch.global_step(upload.job_id)):
                    raise
            flight.resume()

    def _deleted_for_newer(self, upload: Upload) -> bool:
        """Whether ``upload``'s checkpoint is gone while a newer commit of its job is queued: the
        job's own retention (``keep``) deleted it, not a checkpoint to refuse."""
        with self._cond:
            newer = self._queue.get(upload.job_id)
        return newer is not None and newer.step > upload.step and not os.path.lexists(upload.path)

    def _proposed(self, upload: Upload) -> Upload:
        """The upload to send: ``upload``, or the older step node 0 proposed, pinned here since its
        commit (:mod:`.upload_pins`; on node 0 too) or, on another node, still committed
        (:mod:`.upload_fleet`); ``upload`` then queued again behind it."""
        job, pinned = upload.job_id, self.pins.get(upload.job_id)
        if pinned is not None and pinned[0] <= self.watch.global_step(job):
            self.pins.release(job, pinned[0])  # global meanwhile
        elif pinned is not None and pinned[0] <= upload.step:
            self.fleet.finish(job, pinned[0])  # finished although superseded, on every node
            return upload if pinned[0] == upload.step else self._before(upload, pinned[0], pinned[1])
        step = self.fleet.target(self.durable.store, job, upload.step, upload.path, self.watch.global_step(job))
        return upload if step is None else self._before(upload, step, str(Path(upload.path).parent / step_name(step)))

    def _before(self, upload: Upload, step: int, path: str) -> Upload:
        """Send ``step`` (at ``path``) of ``upload``'s job first; ``upload`` waits in the queue."""
        older = Upload(upload.job_id, path, step, submitted=upload.submitted)
        with self._cond:
            self._current = older
            self._enqueue(upload)
        return older

    def _set_progress(self, done: int, total: int) -> None:
        self._progress = (done, total)  # lock held (Flight)

    def _why_abandon(self, upload: Upload) -> type[Exception] | None:
        """Superseded by a newer commit of its job, or pre-empted by another job's newer commit
        (ready to go) while a notice is pending; lock held."""
        if upload.job_id in self._queue and not self.finish_superseded and not self._stop:
            # finished all the same: the step node 0 proposed (every node of the fleet finishes it,
            # node 0 too), or, on a single node, any while its uploads are behind its saves
            # (GlobalWatch.finish); while a notice is pending, Preempted below lets the newest go
            if not self.fleet.finishes(upload.job_id, upload.step) and (
                    self.fleet.coordinated(upload.job_id) or not self.watch.finish_anyway(upload.job_id, upload.step)):
                return Superseded
        now = time.time()
        if any(u.submitted > upload.submitted and u.not_before <= now for u in self._queue.values()) \
                and self._urgent():
            return Preempted
        return None

    def _urgent(self) -> bool:
        try:
            return bool(self.urgent())
        except Exception:  # noqa: BLE001 - read from another thread without a lock: a guess is enough
            return False

    def _refuse(self, upload: Upload, exc: Exception) -> None:
        """A checkpoint that cannot be uploaded as committed: say so once, drop it, go on."""
        self.metrics.refused.inc()
        self.pins.release(upload.job_id, upload.step)
        log.error("not uploading %s step %d (%s): %s", upload.job_id, upload.step, upload.path, exc)
        with self._cond:
            self._refused[upload.job_id] = {"step": upload.step, "path": _printable(upload.path),
                                            "error": _printable(str(exc))}
        self._finish(upload, None)

    def _failed(self, upload: Upload, exc: Exception) -> None:
        self.metrics.failures.inc()
        delay = backoff(0.5, upload.attempts, self.retry_max)
        log.warning("upload of %s step %d failed (attempt %d): %s; retrying in %.1fs",
                    upload.job_id, upload.step, upload.attempts, exc, delay)
        with self._cond:
            self._current = None
            upload.not_before = time.time() + delay
            self._enqueue(upload)
            self._cond.notify_all()

    def _finish(self, upload: Upload, info: DurableInfo | None) -> None:
        """Record ``upload`` as done (durable when ``info`` is given: journal, gauge, then the
        ``durable`` event); retention runs only after this, so it never delays durability."""
        with self._cond:
            self._current = None
            if info is not None and info.step >= self._durable.get(upload.job_id, {}).get("step", -1):
                self._durable[upload.job_id] = {"step": info.step, "at": time.time(),
                                                "key": info.manifest_key}
                self.metrics.durable_step.set(info.step)
            self.metrics.depth.set(len(self._queue))
            self._save_journal()
            self._cond.notify_all()
        if info is not None:
            self.on_durable(upload.job_id, info.step, info.manifest_key)

    # ------------------------------------------------------------------ journal

    def _age(self) -> float:
        times = [d["at"] for d in self._durable.values()]
        return time.time() - max(times) if times else float("nan")

    def _restore_durable_step(self) -> None:
        """Set the last-durable-step gauge from the journal, so that a restarted daemon does not
        report 0 (the age gauge reads the journaled times already)."""
        newest = max(self._durable.values(), key=lambda d: d["at"], default=None)
        if newest is not None:
            self.metrics.durable_step.set(newest["step"])

    def _save_journal(self) -> None:
        """Journal what is queued, uploading and durable; never raises (see :class:`Journal`)."""
        entries = list(self._queue.values()) + ([self._current] if self._current else [])
        self.journal.save(entries, self._durable)

    def _retry_journal(self) -> None:
        if self.journal.dirty:
            self._save_journal()


def _printable(text: str) -> str:
    """``text`` with lone surrogates (undecodable path bytes) escaped: replies must be UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _shown(upload: Upload) -> dict[str, Any]:
    return {**asdict(upload), "path": _printable(upload.path)}


def _check_job(job_id: str) -> None:
    try:
        manifest_key(job_id, 0)
    except ValueError as exc:
        raise confine.UnsafeCheckpoint(str(exc)) from None


def from_settings(settings: Any, *, registry: CollectorRegistry | None = None,
                  on_durable: Callable[[str, int, str], None] | None = None,
                  urgent: Callable[[], bool] = lambda: False) -> UploadQueue | NoStoreQueue:
    """The queue for the daemon's ``storage`` settings (``file://<state_dir>/durable`` by default;
    a :class:`NoStoreQueue` for ``none``).

    Opening a store does no I/O: :meth:`Store.check` reports a bad bucket or credential later."""
    if settings.storage_url is None:
        return NoStoreQueue(registry)
    storage = settings.storage
    store = open_store(settings.storage_url, StoreOptions.of(storage))
    return UploadQueue(Durable(store, concurrency=storage.concurrency),
                       settings.state_dir / "uploads.json", keep=storage.keep,
                       finish_superseded=storage.finish_superseded, nice=storage.upload_nice,
                       bandwidth_mbps=storage.bandwidth_mbps, on_durable=on_durable, registry=registry,
                       url=settings.storage_url, root=settings.checkpoint_root,
                       staging=settings.runtime_dir / "upload-staging", urgent=urgent,
                       lag_bound=storage.durable_lag_seconds, max_superseded=storage.max_superseded)
