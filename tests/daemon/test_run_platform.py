"""``spotguard run`` decides from the daemon's pending notices whether to relaunch: a real daemon
watching the AWS simulator, a job that does not import spotguard (``run_job.py``).

* a spot interruption due in 120 s is pending: the node is going, the supervisor exits 75;
* the same notice with ``--useful-seconds 60``: far enough for useful work, relaunched;
* the notice cancelled before the job exits: relaunched.
"""

from __future__ import annotations

import time

import httpx
import pytest
from spotguard.protocol import StatusRequest
from test_run_supervisor import Supervised, runtime, wait_registered


def control(url: str, op: str, **body) -> dict:
    response = httpx.post(f"{url}/_sim/{op}", json=body, timeout=5)
    response.raise_for_status()
    return response.json()


@pytest.fixture
def aws(simulator, daemon_factory):
    url = simulator("aws")
    daemon = daemon_factory("--platform", "aws", env={
        "SPOTGUARD_AWS__ENDPOINT": url, "SPOTGUARD_AWS__INTERVAL": "0.2",
        "SPOTGUARD_RUNNER__BACKOFF_INITIAL": "0.1", "SPOTGUARD_RUNNER__REQUEST_TIMEOUT": "1"})
    return url, daemon


def interrupted(tmp_path, aws, options: list[str], job: list[str] = ()) -> tuple[Supervised, dict]:
    """The job under ``spotguard run``, once it got the daemon's signal for a spot interruption."""
    url, daemon = aws
    run = Supervised(tmp_path, options, list(job), runtime(daemon))
    run.wait_file("ready-1")
    wait_registered(daemon, run.launches()[0])
    event = control(url, "schedule", kind="terminate", in_seconds=0.1, deadline_seconds=120)
    assert run.wait_file("got-1") == "SIGUSR1"
    return run, event


@pytest.mark.parametrize("options, relaunched", [([], False), (["--useful-seconds", "60"], True)])
def test_a_pending_platform_notice_stops_the_relaunch_unless_its_deadline_is_far(
        tmp_path, aws, options, relaunched):
    run, _ = interrupted(tmp_path, aws, options)
    status, figures = run.finish()
    assert figures["launches"] == (2 if relaunched else 1), run.stderr()
    if relaunched:
        assert status == 0 and "relaunching it" in run.stderr()
    else:
        assert status == 75 and figures["reason"] == "node going away"
        assert "(terminate, due in 1" in run.stderr()
        assert "exiting 75 so that the scheduler places the job elsewhere" in run.stderr()


def test_a_cancelled_notice_is_relaunched(tmp_path, aws):
    url, daemon = aws
    run, event = interrupted(tmp_path, aws, [], ["--wait"])
    control(url, "cancel", id=event["id"])
    deadline = time.monotonic() + 10
    while daemon.request(StatusRequest()).data["notices"]:
        assert time.monotonic() < deadline, daemon.output()[-2000:]
        time.sleep(0.05)
    (run.dir / "go-1").write_text("go")
    status, figures = run.finish()
    assert status == 0 and figures["launches"] == 2 and figures["preemptions"] == 1, run.stderr()
