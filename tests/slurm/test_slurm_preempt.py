"""Partition-priority preemption on a real Slurm cluster: save within GraceTime, requeue, exact resume.

The job is deploy/slurm/train.sbatch running examples/train_loader.py (a shuffled spotguard.DataLoader
with two workers, dropout, AdamW and a warm-up + cosine LambdaLR) in the ``low`` partition. A job
submitted to ``high`` preempts it: Slurm sends the script's ``--signal`` (USR1) at once
(``preempt_send_user_signal``) and kills the job ``GraceTime`` seconds later. The job must save and
exit 75 within the grace, be requeued, resume from that checkpoint with ``SLURM_RESTART_COUNT=1``
in its run record, and end with the same final state as an uninterrupted run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from slurm_cluster import wait_for
from slurm_job import EXAMPLE, read_record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN = ("--steps", "250", "--workers", "2", "--save-every", "25", "--step-sleep", "0.02")


def reference_run(tmp_path) -> subprocess.Popen:
    """The same training, never interrupted, outside Slurm."""
    workdir = tmp_path / "reference"
    workdir.mkdir()
    env = {**os.environ, "SPOTGUARD_RECORD": str(workdir / "record.jsonl"), "SPOTGUARD_RUNTIME_DIR": str(workdir)}
    return subprocess.Popen([sys.executable, str(EXAMPLE), *TRAIN, "--ckpt-dir", "checkpoints"], cwd=workdir,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_preempted_job_saves_within_grace_is_requeued_and_resumes_exactly(make_job, slurm, tmp_path):
    reference = reference_run(tmp_path)
    try:
        job = make_job()
        job.submit("--partition", "low", "--cpus-per-task", "2", args=TRAIN)
        job.wait_event("commit", timeout=120)

        preempted_at = time.time()
        high = slurm.sbatch("--partition", "high", "--cpus-per-task", "2", "--wrap", "sleep 1", cwd=job.workdir)
        stop = job.wait_event("stop", timeout=slurm.grace_time + 30)[0]
        assert stop["notice"]["kind"] == "signal"
        commit = job.stopped_at_checkpoint(stop)
        assert commit["t"] < preempted_at + slurm.grace_time          # committed within the GraceTime
        assert job.wait_settled(timeout=slurm.grace_time + 30) == "PENDING"
        assert slurm.job(job.id)["Restarts"] == "1" and "requeueing job" in job.output()

        wait_for("the high-priority job done", lambda: slurm.job(high).get("JobState") == "COMPLETED", 60)
        slurm.release(job.id)                      # Slurm would start it 120 s after the requeue
        finish = job.wait_event("finish", timeout=120)[0]
        assert reference.wait(timeout=120) == 0
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()

    first, second = job.events("start")
    assert first["restart_count"] is None and first["resumed_from"] is None
    assert second["restart_count"] == 1 and second["resumed_from"] == stop["step"]
    expected = read_record(tmp_path / "reference" / "record.jsonl", "finish")[0]
    assert finish["step"] == expected["step"] and finish["digest"] == expected["digest"]
    assert job.wait_settled(timeout=30) == "COMPLETED"

