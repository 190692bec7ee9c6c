"""Goodput cannot be forged (issue 21 item 2): an unproven ``tcp://`` peer writes no job's ledger and
nothing into the durable store; a report may not date back past a few minutes nor before its
process registered; the number of jobs whose record reaches the store is capped.

Each test runs a real daemon with a ``file://`` bucket and speaks to it over real ZeroMQ sockets.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import datetime, timedelta, timezone

from spotguard.protocol import ProgressRequest, RegisterRequest, StatusRequest

from test_goodput_fresh_node import progress_object, wait_for
from test_goodput_metrics import samples


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ago(seconds: float) -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=seconds)


def test_a_tcp_peer_writes_no_ledger_and_nothing_to_the_store(daemon_factory, tmp_path):
    """The attacks of the issue, over tcp://: progress dated an hour back, a forged rank-0 restart
    under a victim's job id, progress for many made-up jobs. Before: training seconds inflated,
    steps lost counted, one progress.json per made-up job in the bucket."""
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}",
                                 "SPOTGUARD_ZMQ__REQUEST_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"})
    pid = os.getpid()
    first = daemon.request(ProgressRequest(pid=pid, job_id="victim", step=10, at=_ago(3500)))
    assert not first.ok and "unproven" in first.error
    assert not daemon.request(ProgressRequest(pid=pid, job_id="victim", step=20, at=_ago(1))).ok
    assert daemon.request(RegisterRequest(pid=pid, job_id="victim", rank=0, resumed_from_step=0)).ok
    for n in range(50):
        assert not daemon.request(ProgressRequest(pid=pid, job_id=f"made-up-{n}", step=1, at=_ago(1))).ok
    assert daemon.request(StatusRequest()).ok
    time.sleep(1.0)  # several housekeeping turns: any copy would have been written by now
    values = samples(daemon)
    assert values["spotguard_training_seconds_total"] == 0
    assert values["spotguard_steps_lost_total"] == 0 and values["spotguard_job_restarts_total"] == 0
    assert not list(bucket.glob("jobs/*/progress.json"))
    assert daemon.output().count("progress refused: the sender is unproven") == 1  # once per cause


def test_a_report_may_not_date_before_its_registration_nor_minutes_back(daemon_factory, tmp_path):
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{tmp_path / 'bucket'}"})
    pid = os.getpid()
    old = daemon.request(ProgressRequest(pid=pid, job_id="j", step=1, at=_ago(600)))
    assert not old.ok and "old" in old.error
    assert daemon.request(ProgressRequest(pid=pid, job_id="j", step=1, at=_ago(120))).ok  # not registered
    assert daemon.request(RegisterRequest(pid=pid, job_id="j")).ok
    early = daemon.request(ProgressRequest(pid=pid, job_id="j", step=2, at=_ago(60)))
    assert not early.ok and "before its process registered" in early.error
    assert daemon.request(ProgressRequest(pid=pid, job_id="j", step=3, at=_ago(0))).ok
    assert samples(daemon)["spotguard_training_seconds_total"] <= 125  # never the 3500 s of the issue


def test_the_jobs_copied_to_the_store_are_capped(daemon_factory, tmp_path):
    from spotguard_daemon.core.goodput_store import MAX_STORE_JOBS

    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    for n in range(MAX_STORE_JOBS + 20):
        assert daemon.request(ProgressRequest(pid=os.getpid(), job_id=f"job-{n}", step=1, at=_ago(0))).ok
    wait_for(lambda: progress_object(bucket, f"job-{MAX_STORE_JOBS - 1}") is not None, "the last job allowed")
    time.sleep(1.0)  # several housekeeping turns
    assert len(list(bucket.glob("jobs/*/progress.json"))) == MAX_STORE_JOBS
    assert daemon.output().count("not copying the progress of job") == 1
    assert daemon.request(StatusRequest()).ok and daemon.proc.poll() is None
