"""Steps and time lost after the last commit, and the downtime, as a real daemon counts them.

A real job (``goodput_job.py``, a :class:`spotguard.Run` reporting its progress) commits step 4,
runs to step 7, waits there until the daemon acknowledged that progress, and is SIGKILLed;
relaunched, it resumes from step 4 on its own disk: the daemon must count exactly 3 steps lost,
under the tier ``local``, with or without a daemon restart in between. Malformed progress requests
are refused; a guard sends rank 0's newest progress at most once per interval, and once more when it
closes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from spotguard.guard import Guard
from spotguard.protocol import ProgressRequest, RegisterRequest, StatusRequest

from test_goodput_metrics import samples, tiers

JOB = Path(__file__).with_name("goodput_job.py")
STEP_SLEEP = 0.1


def launch(daemon, root: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(SPOTGUARD_RUNTIME_DIR=str(daemon.runtime_dir), SPOTGUARD_PROGRESS_SECONDS="0.01")
    return subprocess.Popen([sys.executable, str(JOB), str(root), "--total", "9", "--save-every", "4",
                             "--step-sleep", str(STEP_SLEEP), *args], env=env)


def hold_and_kill(job: subprocess.Popen, ready: Path) -> None:
    """Wait until the job holds at its step with that progress acknowledged, then SIGKILL it."""
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists() and ready.read_text() == "7", "the job did not reach step 7 acknowledged"
    finally:
        job.kill()
        job.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("restart_daemon", [False, True], ids=["same-daemon", "daemon-restarted"])
def test_a_killed_job_counts_the_steps_run_after_its_last_commit(daemon_factory, tmp_path, restart_daemon):
    daemon = daemon_factory()
    root, ready = daemon.checkpoint_root / "job", tmp_path / "ready"
    began = time.monotonic()
    hold_and_kill(launch(daemon, root, "--hold", "7", "--ready", str(ready)), ready)
    if restart_daemon:
        assert daemon.stop() == 0
        daemon.start()
    again = launch(daemon, root)
    assert again.wait(60) == 0
    elapsed = time.monotonic() - began
    values = samples(daemon)
    assert values["spotguard_job_restarts_total"] == 1
    assert values["spotguard_steps_lost_total"] == 3  # steps 5, 6, 7 after the commit of step 4
    assert tiers(daemon, "spotguard_steps_lost_total")["local"] == 3  # resumed from the node's own disk
    # Step 7 was reached at least two sleeps after the first report at or past step 4 (step 5 at worst).
    assert 2 * STEP_SLEEP <= values["spotguard_time_lost_seconds_total"] <= elapsed
    assert 0 < values["spotguard_downtime_seconds_total"] <= elapsed
    assert values["spotguard_training_seconds_total"] >= 4 * STEP_SLEEP  # the relaunch's steps 5-9 at least


def test_malformed_progress_reports_are_refused(daemon_factory):
    daemon = daemon_factory()
    now = datetime.now(timezone.utc).isoformat()
    good = {"v": 1, "type": "progress", "pid": os.getpid(), "job_id": "j", "step": 5, "at": now}
    bad = [{**good, "step": -1}, {**good, "step": "five"}, {**good, "step": 2**63},
           {**good, "at": "2026-01-01T00:00:00"}, {**good, "at": "yesterday"},
           {k: v for k, v in good.items() if k != "at"}, {**good, "job_id": "x" * 257},
           {**good, "extra": 1}, {**good, "v": 2}, {**good, "pid": 0},
           {**good, "at": "1970-01-02T00:00:00Z"}]  # too old to trust: its age would count as downtime
    for message in bad:
        reply = daemon.request(json.dumps(message).encode())
        assert not reply.ok and reply.error, message
    assert daemon.request(StatusRequest()).ok
    assert daemon.request(ProgressRequest(pid=os.getpid(), job_id="j", step=5,
                                          at=datetime.now(timezone.utc))).ok


def progress_requests(daemon) -> float:
    text = httpx.get(daemon.request(StatusRequest()).data["metrics"], timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "spotguard_requests_total" and s.labels == {"type": "progress", "outcome": "ok"})


def test_rank_0_sends_its_newest_progress_once_per_interval_and_at_close(daemon_factory):
    daemon = daemon_factory()
    endpoints = {"pub_endpoint": daemon.pub_endpoint, "request_endpoint": daemon.request_endpoint}
    guard = Guard(job_id="g", rank=0, progress_interval=3600, **endpoints)
    other = Guard(job_id="g", rank=1, progress_interval=0.01, **endpoints)
    try:
        guard.report_progress(1)  # the first report goes at once
        for _ in range(200):
            if guard.progress_acknowledged == 1:
                break
            time.sleep(0.02)
        assert guard.progress_acknowledged == 1
        guard.report_progress(2)
        time.sleep(0.3)  # several turns of the guard's loop: none may send within the interval
        guard.report_progress(3)  # only the newest goes, at close
        other.report_progress(9)  # rank 1 reports nothing
    finally:
        other.close()
        guard.close()
    assert progress_requests(daemon) == 2
    assert daemon.request(RegisterRequest(pid=os.getpid(), job_id="g", resumed_from_step=0)).ok
    assert samples(daemon)["spotguard_steps_lost_total"] == 3
