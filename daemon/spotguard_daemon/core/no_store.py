"""The upload queue of a daemon without a durable store (``storage.url = "none"``).

Exceptions: none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from spotguard.storage.fresh_node import DEFAULT_JOB

from spotguard_daemon.core.upload_journal import UploadMetrics

__all__ = ["NoStoreQueue"]

log = logging.getLogger(__name__)


class NoStoreQueue:
    """The queue of a daemon without a durable store (``storage.url = "none"``): a commit is
    accepted and nothing is copied, so nothing ever becomes durable and no ``durable`` event is
    published (a client must never be told a checkpoint is safe when it is not); a node stop waits
    for no upload. The interface of :class:`~.uploads.UploadQueue`; its metrics exist, so dashboards and
    alerts keep their series, and stay at their idle values (nothing durable: the age is NaN)."""

    store = None

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.metrics = UploadMetrics(registry)
        self.metrics.durable_age.set_function(lambda: float("nan"))

    def start(self) -> None:
        log.info("no durable store (storage.url = none): committed checkpoints are not uploaded")

    def submit(self, job_id: str, path: Path, step: int, size_bytes: int = 0) -> None:
        log.debug("not uploading %s step %d: no durable store", job_id or DEFAULT_JOB, step)

    def time_to_durable(self, job_id: str) -> float | None:
        return None

    def durable_step(self, job_id: str) -> int | None:
        return None

    def idle(self) -> bool:
        return True

    def wait_idle(self, timeout: float) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        """:meth:`UploadQueue.status`'s shape, empty, with ``store`` None and ``disabled`` true."""
        return {"store": None, "disabled": True, "pending": [], "uploading": None,
                "bytes_pending": 0, "durable": {}, "refused": {}, "retention_retry": {}, "worker": None,
                "journal_ok": True}

    def close(self, timeout: float = 5.0) -> None:
        pass
