"""Steps and time lost after the last commit, and the downtime, as a real daemon counts them.

A real job (``goodput_job.py``, a :class:`spotguard.Run` reporting its progress) commits step 4, runs
to step 7, waits there until the daemon acknowledged that progress, and is SIGKILLed; relaunched, it
resumes from step 4: the daemon must count exactly 3 steps lost, with or without a daemon restart
in between. Malformed progress requests are refused and change nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from spotguard.protocol import ProgressRequest, StatusRequest

from test_goodput_metrics import samples

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
           {**good, "extra": 1}, {**good, "v": 2}, {**good, "pid": 0}]
    for message in bad:
        reply = daemon.request(json.dumps(message).encode())
        assert not reply.ok and reply.error, message
    assert daemon.request(StatusRequest()).ok
    assert daemon.request(ProgressRequest(pid=os.getpid(), job_id="j", step=5,
                                          at=datetime.now(timezone.utc))).ok
