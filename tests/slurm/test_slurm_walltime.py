"""The daemon's Slurm walltime watcher against real squeue/scontrol, and a real job saved before its limit."""

from __future__ import annotations

import asyncio
import math
import os
import time
from datetime import datetime, timezone

import pytest
from slurm_cluster import tool, wait_for
from spotguard.protocol import Kind
from spotguard_daemon.core.settings import Settings
from spotguard_daemon.core.watchers.slurm import SlurmWalltimeWatcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def epoch(cluster, job_id: str, field: str) -> int:
    """A job's time field (``%S`` start, ``%e`` end) as Unix seconds, whatever the time zone."""
    out = cluster.run("squeue", "-h", "-j", job_id, "-o", field, env={"SLURM_TIME_FORMAT": "%s"})
    return int(out.strip())


def poll(cluster, job_id: str, lead: float, **env: str):
    environ = {**cluster.env, "SLURM_JOB_ID": job_id, **env}
    return asyncio.run(SlurmWalltimeWatcher(Settings(slurm={"lead": lead}), environ).poll())


def test_real_end_time_whatever_the_time_zone_and_time_format(slurm, tmp_path):
    job = slurm.sbatch("--time=7", "--wrap", "sleep 300", cwd=tmp_path)
    wait_for("the job running", lambda: slurm.job(job).get("JobState") == "RUNNING", 30)
    end = datetime.fromtimestamp(epoch(slurm, job, "%S") + 7 * 60, timezone.utc)
    assert epoch(slurm, job, "%e") == end.timestamp()

    for zone in ("UTC0", "EST5EDT", "IST-5:30", "NZST-12"):     # the user's TZ and time format change nothing
        notices = poll(slurm, job, 3600, TZ=zone, SLURM_TIME_FORMAT="relative")
        assert [(n.kind, n.deadline) for n in notices] == [(Kind.WALLTIME, end)], zone
    assert poll(slurm, job, 60) == []                              # seven minutes left: not yet


def test_scontrol_fallback_and_no_limit(slurm, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Socket timed out' >&2\nexit 1\n")
    (bindir / "squeue").chmod(0o700)
    os.symlink(tool("scontrol"), bindir / "scontrol")
    job = slurm.sbatch("--time=5", "--wrap", "sleep 300", cwd=tmp_path)
    wait_for("the job running", lambda: slurm.job(job).get("JobState") == "RUNNING", 30)
    end = datetime.fromtimestamp(epoch(slurm, job, "%e"), timezone.utc)
    settings = Settings(slurm={"lead": 3600, "squeue": str(bindir / "squeue")})
    watcher = SlurmWalltimeWatcher(settings, {**slurm.env, "SLURM_JOB_ID": job, "TZ": "EST5EDT"})
    assert [n.deadline for n in asyncio.run(watcher.poll())] == [end]

    slurm.run("scancel", job)
    unlimited = slurm.sbatch("--wrap", "sleep 300", cwd=tmp_path)      # the partition has no MaxTime
    wait_for("the job running", lambda: slurm.job(unlimited).get("JobState") == "RUNNING", 30)
    assert poll(slurm, unlimited, 3600) == []


def test_job_saves_on_the_daemons_walltime_notice_before_its_limit(make_job, slurm):
    """Once training runs (its start takes 5 to 25 s on a loaded machine), its time limit is cut with
    `scontrol update TimeLimit` to end 15 to 75 s later. The job's own daemon (`slurm.lead` 120 s,
    polling every second) sees the new end time; training saves and exits 75 well before it, and the
    script requeues the job."""
    job = make_job(env={"SPOTGUARD_SLURM__LEAD": "120", "SPOTGUARD_SLURM__INTERVAL": "1"})
    script, line = job.workdir / "train.sbatch", "#SBATCH --signal=B:USR1@120\n"
    assert line in script.read_text()   # Slurm may send --signal up to a minute early: only the daemon here
    script.write_text(script.read_text().replace(line, ""))
    job.submit("--partition", "low", "--cpus-per-task", "2", "--time=10",
               args=("--steps", "20000", "--workers", "2", "--save-every", "25", "--step-sleep", "0.02"))
    job.wait_event("commit", timeout=120)
    assert not job.events("stop")                 # ten minutes, lead two: no notice yet

    cut_at = time.time()
    minutes = math.ceil((cut_at - epoch(slurm, job.id, "%S") + 15) / 60)
    slurm.run("scontrol", "update", f"JobId={job.id}", f"TimeLimit={minutes}")
    end = epoch(slurm, job.id, "%e")
    stop = job.wait_event("stop", timeout=120)[0]
    assert stop["notice"]["kind"] == "walltime" and stop["t"] > cut_at
    assert job.stopped_at_checkpoint(stop)["t"] < end - 5
    wait_for("the script's end", lambda: "training exited 75" in job.output(), 60)
    assert job.wait_settled(timeout=30) == "PENDING" and "requeueing job" in job.output()
