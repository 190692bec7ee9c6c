"""Goodput across nodes: the daemon's copy of a job's progress in the durable store.

Two daemons with their own runtime, state and checkpoint directories stand for two nodes sharing one
bucket (the ``file://`` backend). A real job (``goodput_job.py``) commits step 4 on node A, runs to
step 7 and is SIGKILLed together with node A's daemon; relaunched on node B it restores step 4 from
the bucket, and node B's daemon must count the 3 steps lost from the object node A left there.
Losses read from the store are counted under the tier the restart's register named (``bucket`` for
the job above, which restored its checkpoint from the bucket). Hostile or garbage objects are
ignored with one warning each, never echoed, never fatal; the copy is made at a job's first change,
then once per interval, or at once while a terminating notice is pending.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from spotguard.protocol import (Kind, NotifyRequest, ProgressRequest, RegisterRequest, StatusRequest,
                                UnregisterRequest)
from spotguard.storage.durable import Durable
from spotguard.storage.file import FileStore

from test_goodput_loss import launch
from test_goodput_metrics import ZERO, samples, tiers

JOB = "goodput-e2e"


def progress_object(bucket: Path, job: str = JOB) -> dict | None:
    path = bucket / "jobs" / job / "progress.json"
    return json.loads(path.read_bytes()) if path.exists() else None


def copied(record: dict | None) -> tuple[int, int] | None:
    """The step and the newest commit a progress object holds (None: no object, or no commit)."""
    return (record["step"], record["reached"][-1][0]) if record and record["reached"] else None


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def node_b(daemon_factory, tmp_path):
    """A second daemon class instance with directories of its own (another node); killed after."""
    sock = Path(tempfile.mkdtemp(prefix="sg-b-", dir="/tmp"))
    made = []

    def make(env: dict):
        process_class = type(daemon_factory(start=False))
        (tmp_path / "node-b").mkdir()
        made.append(process_class(sock, tmp_path / "node-b", env=env))
        return made[-1].start()

    yield make
    for daemon in made:
        daemon.kill()
    shutil.rmtree(sock, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(240)  # two daemons, two jobs
def test_a_job_relaunched_on_a_fresh_node_counts_the_steps_lost_with_the_old_one(daemon_factory, node_b,
                                                                                 tmp_path):
    bucket = tmp_path / "bucket"
    env = {"SPOTGUARD_STORAGE__URL": f"file://{bucket}", "SPOTGUARD_STORAGE__PROGRESS_SECONDS": "0.2"}
    node_a, ready = daemon_factory(env=env), tmp_path / "ready"
    began = time.monotonic()
    job = launch(node_a, node_a.checkpoint_root / "job", "--hold", "7", "--ready", str(ready))
    try:
        wait_for(lambda: ready.exists() or job.poll() is not None, "step 7 acknowledged", 60)
        assert ready.read_text() == "7"
        wait_for(lambda: Durable(FileStore(bucket)).latest(JOB) == 4, "step 4 durable")
        # The commit of step 4 and the report of step 7 reach the daemon in either order (the commit
        # comes from the save's own thread), and each lands in the object at its next write.
        wait_for(lambda: copied(progress_object(bucket)) == (7, 4), "the progress object at step 7, commit 4")
    finally:
        job.kill()  # the node is reclaimed: the job and its daemon die without a word
        job.wait(10)
        node_a.kill()
    assert progress_object(bucket)["reached"][-1][0] == 4

    fresh = node_b(env)
    again = launch(fresh, fresh.checkpoint_root / "job")
    assert again.wait(60) == 0, fresh.output()
    elapsed = time.monotonic() - began
    wait_for(lambda: samples(fresh)["spotguard_steps_lost_total"] > 0, "the loss counted on node B")
    values = samples(fresh)
    assert values["spotguard_job_restarts_total"] == 1
    assert values["spotguard_steps_lost_total"] == 3  # steps 5, 6, 7 after the commit of step 4
    assert 0 <= values["spotguard_time_lost_seconds_total"] <= elapsed
    assert 0 < values["spotguard_downtime_seconds_total"] <= elapsed
    assert tiers(fresh, "spotguard_steps_lost_total")["bucket"] == 3  # the Run restored step 4 from the bucket
    assert tiers(fresh, "spotguard_job_restarts_total")["bucket"] == 1
    assert "restored" in fresh.output() or (fresh.checkpoint_root / "job" / "step-0000000004").exists()
    assert progress_object(bucket)["step"] == 9  # node B's copy of the new run replaced node A's


def valid(job: str, now: float, **changes) -> bytes:
    """A sound object of ``job``: step 10 reached 5 s ago, step 6 committed 10 s ago."""
    return json.dumps({"version": 1, "job": job, "step": 10, "at": now - 5, "reached": [[6, now - 10]],
                       "written": now - 4, **changes}).encode()


def hostile_objects(now: float) -> dict[str, bytes]:
    return {
        "garbage": b"\x00\xff not json EVIL-MARKER",
        "huge": b'{"pad": "' + b"EVIL-MARKER" * 4000 + b'"}',
        "deep": b"[" * 10_000,
        "nan": valid("nan", now).replace(str(now - 5).encode(), b"NaN"),
        "extra": valid("extra", now, extra="EVIL-MARKER"),
        "other-job": valid("someone-else", now),
        "future": valid("future", now, at=now + 3600),
        "ancient": valid("ancient", now, at=1.0, reached=[[6, 1.0]]),
        "negative": valid("negative", now, step=-5),
        "many-commits": valid("many-commits", now, reached=[[i, now - 10] for i in range(100)]),
        "wrong-types": valid("wrong-types", now, step="EVIL-MARKER", reached="EVIL-MARKER"),
        "newer-than-restart": valid("newer-than-restart", now, written=now + 3600),
    }


def test_hostile_progress_objects_are_ignored_with_one_warning_each(daemon_factory, tmp_path):
    bucket, now = tmp_path / "bucket", time.time()
    objects = {**hostile_objects(now), "good": b""}
    for job, body in objects.items():
        path = bucket / "jobs" / job / "progress.json"
        path.parent.mkdir(parents=True)
        path.write_bytes(body or valid(job, now, reached=[[6, now - 10], [8, now - 7]]))
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    for job in objects:  # "good" last: once its loss is counted, every object before it was read
        assert daemon.request(RegisterRequest(pid=os.getpid(), job_id=job, resumed_from_step=6)).ok
    wait_for(lambda: samples(daemon)["spotguard_steps_lost_total"] > 0, "the good object's loss")
    values = samples(daemon)
    assert values["spotguard_job_restarts_total"] == len(objects)
    assert values["spotguard_steps_lost_total"] == 2  # only the good object's: 9 and 10 after commit 8
    assert math.isclose(values["spotguard_time_lost_seconds_total"], 2.0, abs_tol=0.01)
    assert values["spotguard_steps_redone_total"] == 2  # 7 and 8: committed on the old node, not resumed
    assert daemon.request(StatusRequest()).ok and daemon.proc.poll() is None
    log = daemon.output()
    for job in hostile_objects(now):
        lines = [line for line in log.splitlines() if f"job {job!r}" in line and "WARNING" in line]
        assert len(lines) == 1, (job, lines)
    assert "EVIL-MARKER" not in log and "Traceback" not in log


def test_a_loss_read_from_the_store_is_counted_under_the_tier_the_restart_named(daemon_factory, tmp_path):
    bucket, now = tmp_path / "bucket", time.time()
    for job in ("from-bucket", "old-client"):
        path = bucket / "jobs" / job / "progress.json"
        path.parent.mkdir(parents=True)
        path.write_bytes(valid(job, now, reached=[[6, now - 10], [8, now - 7]]))
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    assert daemon.request(RegisterRequest(pid=os.getpid(), job_id="from-bucket", resumed_from_step=6,
                                          resumed_tier="bucket")).ok
    assert daemon.request(RegisterRequest(pid=os.getpid(), job_id="old-client", resumed_from_step=6)).ok
    wait_for(lambda: tiers(daemon, "spotguard_steps_lost_total")["unknown"] > 0, "both losses read")
    both = {**ZERO, "bucket": 2, "unknown": 2}  # 9 and 10 after commit 8; 7 and 8 committed, not resumed
    assert tiers(daemon, "spotguard_steps_lost_total") == tiers(daemon, "spotguard_steps_redone_total") == both
    assert tiers(daemon, "spotguard_job_restarts_total") == {**ZERO, "bucket": 1, "unknown": 1}
    assert math.isclose(tiers(daemon, "spotguard_time_lost_seconds_total")["bucket"], 2.0, abs_tol=0.01)
    assert tiers(daemon, "spotguard_downtime_seconds_total")["bucket"] >= 5


def test_the_copy_waits_its_interval_unless_a_terminating_notice_is_pending(daemon_factory, tmp_path):
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})  # every 30 s at most

    def report(step: int) -> None:
        at = datetime.now(timezone.utc)
        assert daemon.request(ProgressRequest(pid=os.getpid(), job_id="rate", step=step, at=at)).ok
    report(1)
    wait_for(lambda: (progress_object(bucket, "rate") or {}).get("step") == 1, "the first change, at once")
    report(2)
    time.sleep(1.5)  # three housekeeping turns: none may copy it within the interval
    assert progress_object(bucket, "rate")["step"] == 1
    assert daemon.request(NotifyRequest(kind=Kind.DRILL)).ok  # a terminating notice
    wait_for(lambda: progress_object(bucket, "rate")["step"] == 2, "the copy under a notice", 10)


@pytest.mark.slow
def test_an_unreachable_store_holds_up_neither_the_restart_nor_the_daemon(daemon_factory):
    with socket.socket() as closed:  # a port nothing listens on: every request is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": "s3://bucket",
                                 "SPOTGUARD_STORAGE__ENDPOINT_URL": f"http://127.0.0.1:{port}",
                                 "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"})
    for job in ("a", "b", "c"):  # each read is retried by the SDK in the background
        assert daemon.request(RegisterRequest(pid=os.getpid(), job_id=job, resumed_from_step=3), 2).ok
        assert daemon.request(ProgressRequest(pid=os.getpid(), job_id=job, step=4,
                                              at=datetime.now(timezone.utc)), 2).ok
    assert daemon.request(StatusRequest(), 2).ok
    assert samples(daemon)["spotguard_job_restarts_total"] == 3
    assert daemon.request(UnregisterRequest(pid=os.getpid())).ok  # its stop signals registered pids
    assert daemon.stop() == 0  # the copies it could not write do not keep it from exiting
