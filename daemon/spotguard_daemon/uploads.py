"""The upload queue: makes committed checkpoints durable in the background, journaled on disk.

::

    commit request --submit()--> journal (uploads.json) --worker thread--> Durable.upload --> prune
                                                                       \\--> on_durable(job, step)

* **One job, one checkpoint in flight, newest first.** A newer commit of a job supersedes an older
  one still queued; one already uploading is abandoned at the next file boundary unless
  ``finish_superseded`` (its objects stay in the bucket and the newer checkpoint reuses them, so the
  abandoned work is not lost). Uploads and retention of one prefix run one at a time, as
  :mod:`spotguard.storage.durable` requires.
* **Journaled.** Every accepted commit is written to ``<state_dir>/uploads.json`` (atomically) before
  the request is answered and removed only once durable, so a daemon killed mid-upload resumes on
  restart; content addressing means objects already in the bucket are not sent again.
* **Background.** The worker thread lowers its CPU priority (``storage.upload_nice``, default 19)
  before it starts; the file pool and the SDKs' transfer threads it creates inherit that niceness
  (Linux niceness is per thread), so hashing and sending a checkpoint yields to a training
  process on the same cores while the daemon's notice loop keeps its normal priority. On 2 cores
  (benchmarks/bench_upload.py, 1 GB) a one-thread training loop slowed by several times at nice 0
  (eight runnable hashing/copy threads), by more than 10 % at nice 10, and by less at nice 19. The
  price: on cores saturated by training an upload progresses slowly, until a notice stops it.
* **Bounded.** File-level concurrency is the store's (``storage.concurrency``); bandwidth is capped on
  average per file (``storage.bandwidth_mbps``); transient store errors are retried with exponential
  backoff, forever but never faster than ``retry_max`` seconds apart, because a checkpoint that is
  not durable yet is exactly what must not be dropped.

Exceptions: none escape the worker; failures are logged once per attempt and retried.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from spotguard._priority import lower_priority
from spotguard.storage.base import StoreError, StoreOptions, open_store
from spotguard.storage.durable import Durable, DurableInfo
from spotguard.storage.file import atomic_write
from spotguard.storage.fresh_node import DEFAULT_JOB

from .redact import redact_url

__all__ = ["UploadQueue", "Upload", "from_settings"]

log = logging.getLogger(__name__)


class Superseded(Exception):
    """Raised inside an upload's progress callback to abandon it for a newer checkpoint."""


@dataclass
class Upload:
    job_id: str
    path: str
    step: int
    size_bytes: int = 0
    submitted: float = field(default_factory=time.time)
    attempts: int = 0


class _UploadMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry or CollectorRegistry()
        self.bytes = Counter("spotguard_upload_bytes_total", "Bytes sent to the durable store.",
                             registry=r)
        self.seconds = Histogram("spotguard_upload_duration_seconds",
                                 "Duration of one checkpoint upload.", registry=r,
                                 buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.failures = Counter("spotguard_upload_failures_total", "Failed upload attempts.", registry=r)
        self.depth = Gauge("spotguard_upload_queue_depth", "Checkpoints waiting to become durable.",
                           registry=r)
        self.durable_step = Gauge("spotguard_upload_last_durable_step",
                                  "Step of the newest durable checkpoint (any job).", registry=r)
        self.durable_age = Gauge("spotguard_upload_last_durable_age_seconds",
                                 "Seconds since the newest checkpoint became durable (NaN: none yet).",
                                 registry=r)


class UploadQueue:
    """Serialises uploads of committed checkpoints to one :class:`Durable` store."""

    def __init__(self, durable: Durable, journal: Path, *, keep: int = 3,
                 finish_superseded: bool = False, bandwidth_mbps: float | None = None, nice: int = 19,
                 on_durable: Callable[[str, int, str], None] | None = None,
                 registry: CollectorRegistry | None = None, retry_max: float = 30.0,
                 url: str = "") -> None:
        self.durable, self.journal, self.keep = durable, journal, keep
        self.url = redact_url(url.split("?", 1)[0])
        """Where checkpoints go, as clients may restore from it (a query string or a password masked)."""
        self.finish_superseded, self.retry_max = finish_superseded, retry_max
        self.bytes_per_second = bandwidth_mbps * 1e6 if bandwidth_mbps else None
        self.nice = nice
        self.on_durable = on_durable or (lambda job, step, key: None)
        self.metrics = _UploadMetrics(registry)
        self.metrics.durable_age.set_function(self._age)
        self._cond = threading.Condition()
        self._queue: dict[str, Upload] = {}
        self._current: Upload | None = None
        self._progress = (0, 0)
        self._durable: dict[str, dict[str, Any]] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._load_journal()

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="spotguard-uploads", daemon=True)
        self._thread.start()

    def submit(self, job_id: str, path: Path, step: int, size_bytes: int = 0) -> None:
        """Queue ``path`` (a committed checkpoint directory) for upload; journaled before return.

        A commit without a job id belongs to the job ``default``, as for the client's restore."""
        job_id = job_id or DEFAULT_JOB
        with self._cond:
            queued = self._queue.get(job_id)
            if queued is not None and queued.step >= step:
                return
            done = self._durable.get(job_id, {}).get("step", -1)
            if step <= done:
                return
            self._queue[job_id] = Upload(job_id, str(path), step, size_bytes)
            self._save_journal()
            self._cond.notify_all()
        log.info("queued %s step %d for upload", job_id or "(default job)", step)

    def durable_step(self, job_id: str) -> int | None:
        with self._cond:
            return self._durable.get(job_id, {}).get("step")

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
            pending = [asdict(u) for u in self._queue.values()]
            current = asdict(self._current) if self._current else None
            done, total = self._progress
            return {"store": self.url, "pending": pending,
                    "uploading": current, "bytes_pending": sum(u["size_bytes"] for u in pending) + (total - done),
                    "durable": {job: dict(d) for job, d in self._durable.items()}}

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker

    def _work(self) -> None:
        lower_priority(self.nice)  # before any pool thread exists: they inherit it
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                upload = self._next()
            self._attempt(upload)

    def _next(self) -> Upload:
        """The newest commit across jobs goes first (on a termination notice it is the one that
        matters); called with the lock held."""
        job = max(self._queue, key=lambda j: self._queue[j].submitted)
        self._current = self._queue.pop(job)
        self._progress = (0, 0)
        self.metrics.depth.set(len(self._queue) + 1)
        return self._current

    def _attempt(self, upload: Upload) -> None:
        upload.attempts += 1
        started = time.monotonic()
        try:
            info = self.durable.upload(Path(upload.path), upload.job_id,
                                       progress=self._progress_hook(upload, started))
        except Superseded:
            log.info("upload of %s step %d superseded by a newer checkpoint", upload.job_id, upload.step)
            self._finish(upload, None)
        except (StoreError, OSError) as exc:
            self._failed(upload, exc)
        else:
            self.metrics.bytes.inc(info.bytes_uploaded)
            self.metrics.seconds.observe(info.seconds)
            self._prune(upload.job_id)
            self._finish(upload, info)

    def _progress_hook(self, upload: Upload, started: float) -> Callable[[int, int], None]:
        def progress(done: int, total: int) -> None:
            with self._cond:
                self._progress = (done, total)
                newer = self._queue.get(upload.job_id)
                if newer is not None and not self.finish_superseded and not self._stop:
                    raise Superseded()
            if self.bytes_per_second:
                ahead = done / self.bytes_per_second - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        return progress

    def _prune(self, job_id: str) -> None:
        try:
            self.durable.prune(job_id, self.keep)
        except StoreError as exc:  # retention is retried after the next upload
            log.warning("retention of %s failed: %s", job_id, exc)

    def _failed(self, upload: Upload, exc: Exception) -> None:
        self.metrics.failures.inc()
        delay = min(self.retry_max, 0.5 * 2 ** min(upload.attempts, 10))
        log.warning("upload of %s step %d failed (attempt %d): %s; retrying in %.1fs",
                    upload.job_id, upload.step, upload.attempts, exc, delay)
        with self._cond:
            self._current = None
            if upload.job_id not in self._queue:
                self._queue[upload.job_id] = upload
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._stop, timeout=delay)

    def _finish(self, upload: Upload, info: DurableInfo | None) -> None:
        with self._cond:
            self._current = None
            if info is not None:
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

    def _save_journal(self) -> None:
        entries = list(self._queue.values()) + ([self._current] if self._current else [])
        body = {"version": 1, "pending": [asdict(u) for u in entries], "durable": self._durable}
        self.journal.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = json.dumps(body, indent=1).encode()
        atomic_write(self.journal, lambda out: out.write(data))

    def _load_journal(self) -> None:
        try:
            body = json.loads(self.journal.read_bytes())
            for entry in body.get("pending", []):
                upload = Upload(**entry)
                if os.path.isdir(upload.path):
                    self._queue[upload.job_id] = upload
                else:
                    log.warning("journaled checkpoint %s is gone; not uploading it", upload.path)
            self._durable = {str(k): dict(v) for k, v in body.get("durable", {}).items()}
        except FileNotFoundError:
            return
        except (ValueError, TypeError, AttributeError) as exc:
            log.error("upload journal %s is unreadable (%s); starting with an empty queue",
                      self.journal, exc)
        if self._queue:
            log.info("resuming %d journaled upload(s)", len(self._queue))
        self.metrics.depth.set(len(self._queue))


def from_settings(settings: Any, *, registry: CollectorRegistry | None = None,
                  on_durable: Callable[[str, int, str], None] | None = None) -> UploadQueue:
    """The queue for the daemon's ``storage`` settings (``file://<state_dir>/durable`` by default).

    Opening a store does no I/O: :meth:`Store.check` reports a bad bucket or credential later."""
    storage = settings.storage
    store = open_store(settings.storage_url, StoreOptions.of(storage))
    return UploadQueue(Durable(store, concurrency=storage.concurrency),
                       settings.state_dir / "uploads.json", keep=storage.keep,
                       finish_superseded=storage.finish_superseded, nice=storage.upload_nice,
                       bandwidth_mbps=storage.bandwidth_mbps, on_durable=on_durable, registry=registry,
                       url=settings.storage_url)
