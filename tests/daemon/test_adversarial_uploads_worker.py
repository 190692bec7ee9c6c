"""The upload worker outlives whatever a store raises: untranslated transport errors are retried, and
even an exception that escapes every handler restarts the worker, counted in metrics and status.

The store is a real :class:`FileStore` behind a thin fault-injecting wrapper (the SDK errors it
raises are the real classes): the faults are the point, and no emulator raises them on demand.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import urllib3.exceptions
from prometheus_client import CollectorRegistry
from spotguard.storage.durable import Durable
from spotguard.storage.file import FileStore

from spotguard_daemon.core.uploads import UploadQueue


class Escaped(BaseException):
    """Not an ``Exception``: nothing in the worker's upload path catches it."""


class FaultyStore:
    """``FileStore`` whose ``put_file`` raises ``faults`` in order, then works."""

    def __init__(self, root: Path, faults: list[BaseException]) -> None:
        self.inner, self.faults, self.lock = FileStore(root), list(faults), threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_file(self, *args, **kwargs):
        with self.lock:
            fault = self.faults.pop(0) if self.faults else None
        if fault is not None:
            raise fault
        return self.inner.put_file(*args, **kwargs)


def make_ckpt(root: Path, step: int, data: bytes) -> Path:
    ckpt = root / f"step-{step:010d}"
    ckpt.mkdir(parents=True)
    (ckpt / "w.bin").write_bytes(data)
    (ckpt / "manifest.json").write_text(json.dumps({
        "format": "spotguard-checkpoint", "version": 1, "step": step, "job_id": "job",
        "files": {"w.bin": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}))
    return ckpt


def run_until_durable(tmp_path: Path, faults: list[BaseException]) -> tuple[UploadQueue, CollectorRegistry]:
    registry = CollectorRegistry()
    store = FaultyStore(tmp_path / "bucket", faults)
    queue = UploadQueue(Durable(store, attempts=1), tmp_path / "state" / "uploads.json", retry_max=0.2,
                        registry=registry, root=tmp_path / "ckpt", staging=tmp_path / "staging")
    queue.start()
    try:
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 3, os.urandom(1000)), 3)
        deadline = time.monotonic() + 20
        while queue.durable_step("job") != 3:
            assert time.monotonic() < deadline, queue.status()
            time.sleep(0.05)
        return queue, registry
    finally:
        queue.close()


def test_untranslated_transport_errors_are_retried_not_fatal(tmp_path):
    faults = [urllib3.exceptions.ProtocolError("Connection reset by peer"), ConnectionResetError(104, "reset"),
              RuntimeError("an SDK bug")]
    queue, registry = run_until_durable(tmp_path, faults)
    assert registry.get_sample_value("spotguard_upload_failures_total") == 3
    assert registry.get_sample_value("spotguard_upload_worker_restarts_total") == 0
    assert queue.status()["refused"] == {}


def test_an_exception_escaping_the_worker_restarts_it_and_is_counted(tmp_path):
    queue, registry = run_until_durable(tmp_path, [Escaped("boom")])
    assert registry.get_sample_value("spotguard_upload_worker_restarts_total") == 1
    status = queue.status()
    assert status["worker"]["restarts"] == 1 and status["pending"] == []
    assert Durable(FileStore(tmp_path / "bucket")).latest("job") == 3
