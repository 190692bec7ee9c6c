"""The daemon's upload queue against real stores: durability, supersession, journal, retries, caps."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time

import pytest
from prometheus_client import CollectorRegistry
from spotguard.storage.durable import Durable
from spotguard.storage.file import FileStore
from spotguard_daemon.core.uploads import UploadQueue

from storage_proxy import Proxy


def _queue(store, tmp_path, **kwargs):
    done: list[tuple[str, int]] = []
    event = threading.Event()

    def on_durable(job, step, key):
        done.append((job, step))
        event.set()

    queue = UploadQueue(Durable(store, concurrency=4), tmp_path / "state" / "uploads.json",
                        on_durable=on_durable, retry_max=0.2, **kwargs)
    return queue, done, event


def test_every_backend_makes_a_commit_durable_and_prunes(store, tmp_path, make_ckpt):
    queue, done, _ = _queue(store, tmp_path, keep=2)
    queue.start()
    try:
        for step in (1, 2, 3):
            ckpt = make_ckpt(tmp_path / "ckpt", step, {"w.bin": bytes([step]) * 1000, "frozen.bin": b"f" * 5000})
            queue.submit("job", ckpt, step, size_bytes=6000)
            assert queue.wait_idle(30)
    finally:
        queue.close()
    assert done == [("job", 1), ("job", 2), ("job", 3)]
    durable = Durable(store)
    assert durable.list("job") == [2, 3]
    assert durable.latest("job") == 3
    assert queue.status()["durable"]["job"]["step"] == 3
    journal = json.loads((tmp_path / "state" / "uploads.json").read_text())
    assert journal["pending"] == []


def test_newer_commit_supersedes_an_upload_in_flight(tmp_path, make_ckpt):
    store = FileStore(tmp_path / "bucket")
    # 8 files of 1 MB at 4 MB/s: the first upload takes about 2 s, so the second commit lands mid-way.
    files = {f"t{i}.bin": bytes([i]) * 1_000_000 for i in range(8)}
    queue, done, _ = _queue(store, tmp_path, bandwidth_mbps=4)
    queue.start()
    try:
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 1, files), 1)
        time.sleep(0.5)
        files["t0.bin"] = b"new" * 1000
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 2, files), 2)
        assert queue.wait_idle(30)
    finally:
        queue.close()
    assert done == [("job", 2)]
    assert Durable(store).list("job") == [2]


def test_finish_superseded_uploads_both(tmp_path, make_ckpt):
    store = FileStore(tmp_path / "bucket")
    files = {f"t{i}.bin": bytes([i]) * 500_000 for i in range(4)}
    queue, done, _ = _queue(store, tmp_path, bandwidth_mbps=4, finish_superseded=True)
    queue.start()
    try:
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 1, files), 1)
        time.sleep(0.2)
        files["t0.bin"] = b"new"
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 2, files), 2)
        assert queue.wait_idle(30)
    finally:
        queue.close()
    assert done == [("job", 1), ("job", 2)]


def test_uploads_behind_the_saves_are_each_finished_until_they_keep_up_and_it_is_said_once(tmp_path, make_ckpt, caplog):
    """One node whose uploads (~0.5 s) are slower than its saves (every 0.2 s): after
    ``max_superseded`` uploads abandoned, every upload a newer commit overtakes is finished (not one
    in ``max_superseded`` + 1, as when the count started again after each); the warning once."""
    caplog.set_level(logging.INFO, logger="spotguard_daemon.core")
    store = FileStore(tmp_path / "bucket")
    queue, done, _ = _queue(store, tmp_path, bandwidth_mbps=4, max_superseded=2)
    queue.start()
    try:
        for step in range(1, 13):
            files = {f"t{i}.bin": os.urandom(250_000) for i in range(8)}  # 2 MB, none sent before
            queue.submit("job", make_ckpt(tmp_path / "ckpt", step, files), step)
            time.sleep(0.2)
        assert queue.wait_idle(30)
    finally:
        queue.close()
    finishing = [r for r in caplog.records if r.getMessage().startswith("finishing the upload of job")]
    assert [r.levelno for r in finishing][:1] == [logging.WARNING] and len(finishing) >= 2, caplog.text
    assert all(r.levelno == logging.INFO for r in finishing[1:])
    assert "so are the next ones while newer commits overtake them" in finishing[0].getMessage()
    assert [s for _, s in done][-1] == 12 and len(done) >= len(finishing) + 1, done
    assert "uploads of job keep up with its saves again (step 12 was not overtaken)" in caplog.text


@pytest.mark.parametrize("notice", [False, True])
def test_a_pending_notice_lets_the_newest_commit_go_before_one_finished_although_superseded(tmp_path, make_ckpt, notice):
    """Behind its saves, an upload is finished although a newer commit came; not while a notice is
    pending: the newest (the emergency save) goes at once."""
    store = FileStore(tmp_path / "bucket")
    queue, done, _ = _queue(store, tmp_path, bandwidth_mbps=4, lag_bound=0.001, urgent=lambda: notice)
    queue.start()
    try:
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 1, {f"t{i}.bin": os.urandom(500_000) for i in range(4)}), 1)
        time.sleep(0.3)
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 2, {"t0.bin": b"final"}), 2)
        assert queue.wait_idle(30)
    finally:
        queue.close()
    assert done == ([("job", 2)] if notice else [("job", 1), ("job", 2)])


def test_bandwidth_cap_is_respected_on_average(tmp_path, make_ckpt):
    store = FileStore(tmp_path / "bucket")
    files = {f"t{i}.bin": bytes([i]) * 1_000_000 for i in range(3)}
    queue, _, _ = _queue(store, tmp_path, bandwidth_mbps=2)
    queue.start()
    started = time.monotonic()
    try:
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 1, files), 1)
        assert queue.wait_idle(30)
    finally:
        queue.close()
    assert time.monotonic() - started >= 1.4  # 3 MB at 2 MB/s, less the first file's head start


def test_journal_resumes_after_a_restart_without_resending(tmp_path, make_ckpt):
    store = FileStore(tmp_path / "bucket")
    ckpt = make_ckpt(tmp_path / "ckpt", 7, {"a.bin": b"a" * 10_000})
    first, done, _ = _queue(store, tmp_path)
    first.submit("job", ckpt, 7)  # never started: as if killed before the upload ran
    second, done2, _ = _queue(store, tmp_path)
    assert [u["step"] for u in second.status()["pending"]] == [7]
    second.start()
    try:
        assert second.wait_idle(30)
    finally:
        second.close()
    assert done2 == [("job", 7)]
    third, _, _ = _queue(store, tmp_path)
    assert third.status()["pending"] == [] and third.durable_step("job") == 7


def test_unreadable_journal_starts_empty(tmp_path):
    journal = tmp_path / "state" / "uploads.json"
    journal.parent.mkdir()
    journal.write_text("{not json")
    queue = UploadQueue(Durable(FileStore(tmp_path / "bucket")), journal)
    assert queue.status()["pending"] == []


def test_transient_store_failures_are_retried_until_durable(moto, new_bucket, tmp_path, make_ckpt):
    from spotguard.storage import StoreOptions, open_store

    direct = new_bucket("s3")
    with Proxy(moto.url, seed=3, fault_rate=0.5, faults=("500", "503", "reset"), max_faults=12) as proxy:
        store = open_store(f"s3://{direct.bucket}/pre", StoreOptions(endpoint_url=proxy.url, max_attempts=1))
        queue, done, _ = _queue(store, tmp_path)
        queue.start()
        try:
            queue.submit("job", make_ckpt(tmp_path / "ckpt", 1, {f"f{i}": bytes([i]) * 2000 for i in range(6)}), 1)
            assert queue.wait_idle(60)
        finally:
            queue.close()
        assert proxy.injected, "the proxy injected no fault: the test proves nothing"
    assert done == [("job", 1)]
    assert Durable(direct).verify("job", 1) == []


class FailingDeletes(Proxy):
    """Answers the first ``max_faults`` S3 DeleteObjects requests with a 503."""

    def pick_fault(self, method: str, path: str) -> str | None:
        with self.lock:
            if method == "POST" and "delete" in path and len(self.injected) < self.max_faults:
                self.injected.append(("503", method, path))
                return "503"
        return None


@contextlib.contextmanager
def two_steps_behind_failing_deletes(moto, direct, tmp_path, make_ckpt, max_faults: int = 1000):
    """A keep=1 queue whose deletes go through FailingDeletes; steps 1 and 2 are durable on entry.
    Yields (queue, done, proxy); the queue is closed on the way out."""
    from spotguard.storage import StoreOptions, open_store

    with FailingDeletes(moto.url, max_faults=max_faults) as proxy:
        store = open_store(f"s3://{direct.bucket}/pre", StoreOptions(endpoint_url=proxy.url, max_attempts=1))
        queue, done, _ = _queue(store, tmp_path, keep=1)
        queue.start()
        try:
            for step in (1, 2):
                queue.submit("job", make_ckpt(tmp_path / "ckpt", step, {"w.bin": bytes([step]) * 1000}), step)
                assert queue.wait_idle(30)
            yield queue, done, proxy
        finally:
            queue.close()
    assert done == [("job", 1), ("job", 2)] and Durable(direct).latest("job") == 2


def test_a_failed_retention_is_retried_without_waiting_for_another_upload(moto, new_bucket, tmp_path, make_ckpt):
    """The bucket refuses the first deletes after step 2 is durable; no step 3 ever comes, yet step 1
    is deleted once the bucket heals (before, it stayed until the job's next upload: maybe never)."""
    direct = new_bucket("s3")
    with two_steps_behind_failing_deletes(moto, direct, tmp_path, make_ckpt, max_faults=3) as (queue, _, proxy):
        deadline = time.monotonic() + 20
        while Durable(direct).list("job") != [2] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(proxy.injected) == 3, proxy.injected
    assert Durable(direct).list("job") == [2]
    assert queue.status()["retention_retry"] == {}


def test_a_bucket_that_never_allows_deletes_is_retried_ever_more_slowly(moto, new_bucket, tmp_path, make_ckpt):
    """A write-only bucket policy (no DeleteObject): uploads still become durable, status names the
    failing retention, and the retries back off (0.2, 0.4, 0.8, ... s here) instead of spinning."""
    direct = new_bucket("s3")
    with two_steps_behind_failing_deletes(moto, direct, tmp_path, make_ckpt) as (queue, _, _):
        time.sleep(3.0)
        retry = queue.status()["retention_retry"]["job"]
    assert Durable(direct).list("job") == [1, 2]
    assert 3 <= retry["failures"] <= 6, retry  # the prune after step 2, then retries 0.2, 0.6, 1.4, 3.0 s on
    assert retry["at"] > time.time(), retry


class StallingDeletes(Proxy):
    """Once ``armed``, holds every S3 DeleteObjects request until ``release`` is set (a bucket whose
    deletes hang)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed, self.release, self.stalled = threading.Event(), threading.Event(), threading.Event()

    def pick_fault(self, method: str, path: str) -> str | None:
        if method == "POST" and "delete" in path and self.armed.is_set():
            self.stalled.set()
            self.release.wait(60)
        return None


def test_a_stalled_delete_does_not_delay_the_durable_event(moto, new_bucket, tmp_path, make_ckpt):
    """keep=1: step 2's retention deletes step 1, and that delete hangs; step 2's ``durable`` event,
    journal entry and gauge still come at once (before, they waited for the delete to end)."""
    from spotguard.storage import StoreOptions, open_store

    direct = new_bucket("s3")
    with StallingDeletes(moto.url) as proxy:
        store = open_store(f"s3://{direct.bucket}/pre", StoreOptions(endpoint_url=proxy.url, max_attempts=1))
        registry, pruned, done, event = CollectorRegistry(), threading.Event(), [], threading.Event()

        class ObservedDurable(Durable):
            def prune(self, job_id, keep, **kwargs):
                try:
                    return super().prune(job_id, keep, **kwargs)
                finally:
                    pruned.set()

        queue = UploadQueue(ObservedDurable(store), tmp_path / "state" / "uploads.json", keep=1,
                            registry=registry, on_durable=lambda job, step, key: (done.append((job, step)), event.set()))
        queue.start()
        try:
            queue.submit("job", make_ckpt(tmp_path / "ckpt", 1, {"w.bin": b"1" * 1000}), 1)
            assert event.wait(30) and pruned.wait(30) and done == [("job", 1)]
            event.clear()
            proxy.armed.set()
            queue.submit("job", make_ckpt(tmp_path / "ckpt", 2, {"w.bin": b"2" * 1000}), 2)
            assert proxy.stalled.wait(30), "retention never deleted: the test proves nothing"
            assert event.wait(5), "the durable event waited for the stalled delete"
            assert done == [("job", 1), ("job", 2)]
            assert registry.get_sample_value("spotguard_upload_last_durable_step") == 2
            journal = json.loads((tmp_path / "state" / "uploads.json").read_text())
            assert journal["durable"]["job"]["step"] == 2
            assert Durable(direct).list("job") == [1, 2]  # the delete is still held
        finally:
            proxy.release.set()
            queue.close()
    assert Durable(direct).list("job") == [2]


def test_a_vanished_checkpoint_is_not_retried_forever(tmp_path, make_ckpt):
    store = FileStore(tmp_path / "bucket")
    journal = tmp_path / "state" / "uploads.json"
    ckpt = make_ckpt(tmp_path / "ckpt", 1, {"a.bin": b"a"})
    queue = UploadQueue(Durable(store), journal)
    queue.submit("job", ckpt, 1)
    import shutil

    shutil.rmtree(ckpt)
    assert UploadQueue(Durable(store), journal).status()["pending"] == []


class RetentionRace(UploadQueue):
    """A queue whose first upload meets the job's next commit and retention (``keep=1``) in the
    instant between taking the upload and opening its files."""

    def __init__(self, *args, race, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.race = race

    def _proposed(self, upload):
        race, self.race = self.race, None
        if race is not None:
            race()
        return super()._proposed(upload)


def test_a_checkpoint_the_job_deleted_for_a_newer_one_is_superseded_not_refused(tmp_path, make_ckpt, caplog):
    """With ``keep=1`` the job deletes a step as it commits the next one, perhaps before the upload of
    the step began. That is a superseded upload (said at INFO), not a checkpoint refused with an error."""
    caplog.set_level(logging.INFO, logger="spotguard_daemon.core.uploads")
    store = FileStore(tmp_path / "bucket")
    old = make_ckpt(tmp_path / "ckpt", 1, {"a.bin": b"1"})

    def commit_and_retain() -> None:
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 2, {"a.bin": b"2"}), 2)
        shutil.rmtree(old)

    queue = RetentionRace(Durable(store), tmp_path / "state" / "uploads.json", race=commit_and_retain)
    queue.submit("job", old, 1)
    queue.start()
    try:
        assert queue.wait_idle(30)
    finally:
        queue.close()
    assert queue.status()["refused"] == {} and Durable(store).list("job") == [2]
    assert "the job deleted it (its retention) for a newer checkpoint" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    shutil.rmtree(tmp_path / "ckpt" / "step-0000000002")  # the newest gone too: nothing newer, refused
    queue = UploadQueue(Durable(store), tmp_path / "state2" / "uploads.json")
    queue.submit("job", make_ckpt(tmp_path / "ckpt", 3, {"a.bin": b"3"}), 3)
    shutil.rmtree(tmp_path / "ckpt" / "step-0000000003")
    queue.start()
    try:
        assert queue.wait_idle(30)
    finally:
        queue.close()
    assert queue.status()["refused"]["job"]["step"] == 3


@pytest.mark.parametrize("older", [True, False])
def test_older_or_equal_steps_are_ignored(tmp_path, make_ckpt, older):
    store = FileStore(tmp_path / "bucket")
    queue, _, _ = _queue(store, tmp_path)
    queue.submit("job", make_ckpt(tmp_path / "ckpt", 5, {"a": b"a"}), 5)
    queue.submit("job", make_ckpt(tmp_path / "other", 4 if older else 5, {"a": b"b"}), 4 if older else 5)
    assert [u["step"] for u in queue.status()["pending"]] == [5]


def test_durable_age_counts_from_the_pointer_write_not_from_retention(tmp_path, make_ckpt):
    pruned_at: list[float] = []

    class RecordingDurable(Durable):
        def prune(self, job_id, keep, **kwargs):
            pruned_at.append(time.time())
            return super().prune(job_id, keep, **kwargs)

    queue = UploadQueue(RecordingDurable(FileStore(tmp_path / "bucket")), tmp_path / "state" / "uploads.json")
    queue.start()
    try:
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 1, {"w.bin": b"w" * 100}), 1)
        assert queue.wait_idle(30)
    finally:
        queue.close()
    durable_at = queue.status()["durable"]["job"]["at"]
    pointer = tmp_path / "bucket" / "jobs" / "job" / "latest"
    assert pointer.stat().st_mtime <= durable_at + 0.01 and durable_at <= pruned_at[0]


def test_a_restarted_queue_reports_the_journaled_durable_step_and_skips_damaged_entries(tmp_path):
    journal = tmp_path / "state" / "uploads.json"
    journal.parent.mkdir()
    journal.write_text(json.dumps({"version": 1, "pending": [], "durable": {
        "a": {"step": 7, "at": 100.0}, "b": {"step": 9, "at": 200.0}, "c": {"step": "x", "at": 300.0},
        "d": {"step": 11, "at": None}, "e": [1]}}))
    registry = CollectorRegistry()
    queue = UploadQueue(Durable(FileStore(tmp_path / "bucket")), journal, registry=registry)
    assert registry.get_sample_value("spotguard_upload_last_durable_step") == 9
    assert sorted(queue.status()["durable"]) == ["a", "b"]
