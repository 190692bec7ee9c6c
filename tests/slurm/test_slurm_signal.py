"""`scancel -b --signal=USR1` on a real Slurm job: a clean stop, the checkpoint committed, exit 75, requeued."""

from __future__ import annotations

import pytest
from slurm_cluster import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN = ("--steps", "2000", "--workers", "2", "--save-every", "25", "--step-sleep", "0.02")


def test_scancel_usr1_stops_cleanly_commits_and_requeues(make_job, slurm):
    job = make_job()
    job.submit("--partition", "low", "--cpus-per-task", "2", args=TRAIN)
    job.wait_event("commit", timeout=120)          # training runs and has saved once

    slurm.run("scancel", "--batch", "--signal=USR1", job.id)
    stop = job.wait_event("stop", timeout=60)[0]
    assert stop["notice"]["kind"] == "signal"
    job.stopped_at_checkpoint(stop)
    job.wait_state("PENDING", timeout=60)         # requeued by the script after exit 75

    assert "training exited 75" in job.output() and "requeueing job" in job.output()
    assert int(slurm.job(job.id)["Restarts"]) == 1
    assert not job.events("finish")


def test_plain_scancel_signal_misses_the_script_and_plain_scancel_ends_the_job(make_job, slurm):
    """`scancel --signal=USR1` without --batch signals job steps only, and this job has none; a plain
    `scancel` (SIGTERM, then SIGKILL) still saves and ends the job for good: no requeue."""
    job = make_job()
    job.submit("--partition", "low", "--cpus-per-task", "2", args=TRAIN)
    job.wait_event("commit", timeout=120)
    slurm.run("scancel", "--signal=USR1", job.id)
    before = len(job.events("commit"))
    job.wait_event("commit", timeout=60, count=before + 2)   # two more periodic saves: it trained on
    assert not job.events("stop") and job.state() == "RUNNING"

    slurm.run("scancel", job.id)
    stop = job.wait_event("stop", timeout=30)[0]
    assert stop["notice"]["kind"] == "signal"
    wait_for("the script's end", lambda: "training exited" in job.output(), 60)
    job.wait_settled(timeout=30)
    assert job.state() == "CANCELLED" and slurm.job(job.id)["Restarts"] == "0"
    assert "requeueing" not in job.output()


def test_usr1_before_training_can_handle_it_still_requeues(make_job, slurm):
    """A USR1 at once (Slurm may send --signal up to a minute early), while the script still starts its
    daemon or Python still imports torch: the shell survives it, and training, killed by it before
    spotguard could handle it, counts as a clean stop: nothing since its start is lost, it is requeued."""
    job = make_job()
    job.submit("--partition", "low", "--cpus-per-task", "2", args=TRAIN)
    wait_for("the job's daemon up", lambda: " ready (platform " in job.output() or "using the daemon" in
             job.output(), 60, 0.05)
    slurm.run("scancel", "--batch", "--signal=USR1", job.id)
    wait_for("the script's end", lambda: "training exited" in job.output(), 60)
    assert "USR1 received" in job.output()
    assert job.wait_settled(timeout=30) == "PENDING" and "requeueing job" in job.output()
    assert "training exited 138" in job.output() and "treating it as a clean stop" in job.output()
    assert not job.events("start")      # spotguard.Run never started: nothing was lost
