"""What the upload queue keeps: one :class:`Upload` per job, its metrics, and the on-disk journal.

The journal (``<state_dir>/uploads.json``) holds every accepted commit not yet durable and each
job's newest durable step, so a restarted daemon resumes. A disk that is full or read-only must not
stop uploads: :meth:`Journal.save` writes atomically (the previous journal stays whole), never
raises, logs the first failure of a run once, counts every one
(``spotguard_upload_journal_errors_total``) and leaves ``dirty`` set so the worker retries; what it
could not record is recovered on restart by the queue's reconcile of ``checkpoint_root``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from spotguard.storage.file import atomic_write

__all__ = ["Journal", "Upload", "UploadMetrics"]

log = logging.getLogger(__name__)


@dataclass
class Upload:
    job_id: str
    path: str
    step: int
    size_bytes: int = 0
    submitted: float = field(default_factory=time.time)
    attempts: int = 0
    not_before: float = 0.0
    """Unix time before which a failed upload is not retried (other jobs' go first meanwhile)."""


class UploadMetrics:
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
        self.global_lag = Gauge("spotguard_upload_global_lag_seconds",
                                "Seconds since this node's oldest commit that no global step covers yet "
                                "(0: its newest commit is global, or nothing waits).", registry=r)
        self.restarts = Counter("spotguard_upload_worker_restarts_total",
                                "Times the upload worker failed and was restarted (a bug).", registry=r)
        self.refused = Counter("spotguard_upload_refused_total",
                               "Committed checkpoints refused as unsafe or inconsistent.", registry=r)
        self.journal_errors = Counter("spotguard_upload_journal_errors_total",
                                      "Failed writes of the upload journal (full or read-only disk).",
                                      registry=r)


class Journal:
    """``uploads.json``: ``ok`` is False while the last write failed, ``dirty`` while one is owed."""

    def __init__(self, path: Path, errors: Counter) -> None:
        self.path, self.errors = path, errors
        self.ok, self.dirty = True, False

    def save(self, entries: list[Upload], durable: dict[str, dict[str, Any]]) -> None:
        body = {"version": 1, "pending": [asdict(u) for u in entries], "durable": durable}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            data = json.dumps(body, indent=1).encode()
            atomic_write(self.path, lambda out: out.write(data))
        except OSError as exc:
            self.errors.inc()
            if self.ok:
                log.error("cannot write the upload journal %s (%s); uploading from memory and retrying",
                          self.path, exc.strerror or exc)
            self.ok, self.dirty = False, True
            return
        if not self.ok:
            log.warning("upload journal %s written again", self.path)
        self.ok, self.dirty = True, False

    def load(self) -> tuple[dict[str, Upload], dict[str, dict[str, Any]]]:
        """The journaled queue (checkpoints still on disk) and durable steps; empty if unreadable."""
        queue: dict[str, Upload] = {}
        try:
            body = json.loads(self.path.read_bytes())
            for entry in body.get("pending", []):
                upload = Upload(**entry)
                upload.not_before = 0.0
                if os.path.isdir(upload.path):
                    queue[upload.job_id] = upload
                else:
                    log.warning("journaled checkpoint %s is gone; not uploading it", upload.path)
            durable = {str(k): dict(v) for k, v in body.get("durable", {}).items() if _sound(v)}
        except FileNotFoundError:
            return {}, {}
        except (ValueError, TypeError, AttributeError, OSError) as exc:
            log.error("upload journal %s is unreadable (%s); starting with an empty queue", self.path, exc)
            return {}, {}
        if queue:
            log.info("resuming %d journaled upload(s)", len(queue))
        return queue, durable


def _sound(entry: Any) -> bool:
    """A journaled durable entry the queue can use: a step and the time it became durable."""
    return isinstance(entry, dict) and type(entry.get("step")) is int \
        and isinstance(entry.get("at"), (int, float)) and not isinstance(entry.get("at"), bool)
