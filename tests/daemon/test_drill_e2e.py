"""``spotguard drill`` as users run it: real subprocesses, real daemons, real signals and kills.

The bundled example passes under all four kinds of preemption; deliberately broken jobs
(``drill_job.py --broken ...``) fail with a diagnosis that names their mistake. Each test checks
that every process the drill printed a pid for is gone afterwards.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard._record import read

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("drill_job.py")
DRILL = [sys.executable, "-m", "spotguard_daemon", "drill"]


def drill(tmp_path: Path, *options: str, job: list[str]) -> subprocess.CompletedProcess:
    """Run the drill on ``job`` (report in tmp_path/report); check it left no process behind."""
    done = subprocess.run([*DRILL, *options, "--report-dir", str(tmp_path / "report"), "--", *job],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    for pid in map(int, re.findall(r"started \(pid (\d+)\)", done.stdout)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return done


def passed_every_kind(tmp_path: Path, done: subprocess.CompletedProcess) -> dict:
    """The drill's report, once checked to say PASSED after one preemption of each kind."""
    assert done.returncode == 0, done.stdout + done.stderr
    assert "spotguard drill: PASSED" in done.stdout
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["passed"] and all(check["ok"] for check in report["checks"])
    assert sorted(row["kind"] for row in report["preemptions"]) == [
        "notice", "short-notice", "sigkill", "sigterm"]
    return report


def job(*args: str) -> list[str]:
    return [sys.executable, str(JOB), "--ckpt-dir", "ckpt", *args]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_job_passes_every_kind_of_preemption(tmp_path):
    """On Run's default cadence, which would not save within the job's 150 steps: the drill gives
    its launches $SPOTGUARD_SAVE_EVERY from the reference's length, and every kind lands."""
    done = drill(tmp_path, "-n", "4", "--seed", "7", job=[
        sys.executable, str(ROOT / "examples" / "train_plain.py"), "--steps", "150",
        "--step-sleep", "0.02", "--ckpt-dir", "ckpt"])
    report = passed_every_kind(tmp_path, done)
    reference = list(read(tmp_path / "report" / "reference.record.jsonl"))
    assert [e["step"] for e in reference if e["event"] == "commit"] == [150], "the default cadence saved"
    start = next(e for e in read(tmp_path / "report" / "launch-01.record.jsonl") if e["event"] == "start")
    assert start["cadence"] == "env" and start["daemon"] is True
    warned = [row for row in report["preemptions"] if row["kind"] in ("notice", "sigterm")]
    assert all(row["steps_lost"] == 0 for row in warned)
    assert (tmp_path / "report" / "reference-checkpoints").is_dir()  # moved aside, not deleted
    assert "<polyline" in (tmp_path / "report" / "timeline.svg").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_that_saves_only_its_weights_fails_with_the_reason(tmp_path):
    done = drill(tmp_path, "-n", "1", "--seed", "1", job=job("--broken", "weights-only"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED (identical): the final training state differs" in done.stderr
    assert "Its checkpoint holds: model, rng." in done.stderr
    assert "what diverges is the resume" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_that_restarts_from_zero_fails_the_resume_check(tmp_path):
    done = drill(tmp_path, "-n", "1", "--no-reference", job=job("--broken", "restart"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"FAILED \(resume\): launch 2 started from scratch although step \d+ was "
                     r"committed", done.stderr)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_loader_seeded_from_the_global_rng_is_judged_by_its_digests(tmp_path):
    """Whether this job resumes exactly depends on the library (which may own the loader's seed);
    the drill's verdict must follow the recorded final digests either way, and name the resume
    as what diverged when they differ."""
    done = drill(tmp_path, "-n", "1", "--seed", "1", job=job("--broken", "global-rng-loader"))
    report = tmp_path / "report"
    finishes = [e["digest"] for name in ("reference", "launch-02")
                for e in read(report / f"{name}.record.jsonl") if e["event"] == "finish"]
    assert len(finishes) == 2, done.stdout + done.stderr
    if finishes[0] == finishes[1]:
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        assert done.returncode == 1, done.stdout + done.stderr
        assert "FAILED (identical)" in done.stderr and "what diverges is the resume" in done.stderr


def test_a_command_that_is_not_a_spotguard_job_fails_clearly(tmp_path):
    done = drill(tmp_path, "--no-reference", job=[sys.executable, "-c", "print('hello')"])
    assert done.returncode == 1
    assert "without starting a spotguard run (no start event)" in done.stderr


def test_a_launch_that_hangs_is_killed_and_named(tmp_path):
    done = drill(tmp_path, "--no-reference", "--launch-timeout", "2", job=["sleep", "60"])
    assert done.returncode == 1
    assert "launch 1 ran longer than --launch-timeout (2 s)" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_torchrun_job_is_preempted_whole(tmp_path):
    """torchrun starts its workers in sessions of their own: a SIGKILL to torchrun's group alone
    would leave them training on. The drill signals every descendant."""
    torchrun = Path(sys.executable).with_name("torchrun")
    done = drill(tmp_path, "-n", "4", "--seed", "7", job=[
        str(torchrun), "--nproc-per-node", "2", str(ROOT / "examples" / "train_plain.py"),
        "--steps", "150", "--save-every", "10", "--step-sleep", "0.02", "--ckpt-dir", "ckpt"])
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert len(report["preemptions"]) == 4 and report["passed"]
    # one timeline line each for the reference and the last launch: rank 0's, not every rank's
    assert len(re.findall(r": finished at step 150 \(digest", done.stdout)) == 2


@pytest.mark.parametrize("options, error", [
    (["--bogus", "--", "true"], "no such option: --bogus"),
    (["-n", "2", "--bogus", "true"], "no such option: --bogus"),
    (["--"], "no command given (spotguard drill [OPTIONS] -- COMMAND [ARGS]...)")])
def test_an_unknown_option_or_no_command_is_a_usage_error_and_nothing_runs(tmp_path, options, error):
    report = tmp_path / "report"
    done = subprocess.run([*DRILL, "--report-dir", str(report), *options], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == f"spotguard: spotguard drill: {error}"
    assert not report.exists()  # the drill never started


@pytest.mark.timeout(120)
def test_it_stops_at_once_when_the_reference_fails_or_the_checkpoint_directory_is_not_empty(tmp_path):
    (tmp_path / "a").mkdir()
    missing = drill(tmp_path / "a", job=[sys.executable, str(tmp_path / "no_such_train.py")])
    assert missing.returncode == 1 and "launch 1" not in missing.stdout, missing.stdout
    said = missing.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("spotguard drill: failed: the reference run (the "
                                                 "command, uninterrupted) exited with status 2 before"), said
    assert "No such file or directory" in said[0] and said[0].endswith("nothing was drilled")

    # What Run records when its checkpoint directory holds step 3 (torch's start-up spared): the
    # drill stops the reference at its start, never waiting for its end.
    resumed = ("import time; from spotguard._record import Recorder; Recorder().start(root='ckpt', "
               "world_size=1, resumed_from=3, skipped=[], total=100); time.sleep(60)")
    held = drill(tmp_path, job=[sys.executable, "-c", resumed])
    assert held.returncode == 1 and "launch 1" not in held.stdout, held.stdout
    assert ("failed: ckpt already holds checkpoints: the reference run resumed from step 3. Point "
            "the job at an empty checkpoint directory") in held.stderr
