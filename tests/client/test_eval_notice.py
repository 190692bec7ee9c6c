"""A notice outside a training step (spotguard._between), with real processes and real signals.

A job with an evaluation inside its loop body (dropout in train mode and ``torch.rand``: it draws
from torch's RNG) gets SIGTERM while it evaluates: the step's state is saved beside the evaluation,
the job exits 75 (at its next ``run.heartbeat()``, right after the commit with
``abandon_between_steps=True``, or at the next boundary), and the relaunch ends with the state digest
of an uninterrupted run. A SIGTERM during the restore, or during the first step, exits 75 at once
with nothing new saved."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard._record import read
from spotguard.checkpoint import Checkpointer

from _example import isolated_env

JOB = Path(__file__).with_name("_eval_notice_job.py")
STEPS = ["--steps", "12", "--eval-every", "4", "--eval-batches", "300"]

pytestmark = pytest.mark.slow


def launch(tmp_path: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB), "--ckpt-dir", str(tmp_path / "ckpt"), *args],
                            env=isolated_env(tmp_path / "rt", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 90) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def signal_at(proc: subprocess.Popen, line: str) -> tuple[list[str], float]:
    """Read the job's lines until ``line``, then SIGTERM it; the lines read and when it was sent."""
    seen = []
    for out in proc.stdout:
        seen.append(out.strip())
        if out.strip() == line:
            proc.send_signal(signal.SIGTERM)
            return seen, time.monotonic()
    raise AssertionError(f"the job ended before printing {line!r}: {seen}")


def digest_of(out: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith("digest "))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The digest of the uninterrupted run."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = launch(tmp, *STEPS)
    out, err = finish(proc)
    assert proc.returncode == 0, err
    return digest_of(out)


@pytest.mark.parametrize("mode", ["heartbeat", "abandon", "boundary"])
def test_a_notice_during_an_evaluation_saves_that_step_and_resumes_bit_identically(tmp_path, reference, mode):
    flags = {"heartbeat": ["--heartbeat"], "abandon": ["--abandon"], "boundary": []}[mode]
    record = {"SPOTGUARD_RECORD": str(tmp_path / "record.jsonl")} if mode == "heartbeat" else {}
    proc = launch(tmp_path, *STEPS, *flags, **record)
    _, sent = signal_at(proc, "eval 7")  # step 7's optimizer step ran; its evaluation takes > 3 s
    out, err = finish(proc)
    assert proc.returncode == 75, err
    assert "emergency save of step 8 beside the work" in err
    assert Checkpointer(tmp_path / "ckpt").latest().step == 8  # the step evaluated, not step 5's save
    if mode == "boundary":  # no heartbeat: the evaluation ends, the boundary stops the loop
        assert "evaluated 7" in out
    else:  # stopped mid-evaluation
        assert "evaluated 7" not in out
    if mode == "abandon":
        assert "abandoned" in err
    resumed = launch(tmp_path, *STEPS, **record)
    out, err = finish(resumed)
    assert resumed.returncode == 0, err
    assert "start 8" in out and "eval 3" not in out
    assert digest_of(out) == reference
    if record:  # the drill's marks: the RNG saved beside the evaluation is the one the relaunch loaded
        marks = {e["at"]: e["rng"] for e in read(record["SPOTGUARD_RECORD"])
                 if e["event"] == "marks" and e["step"] == 8}
        assert marks["save"] == marks["load"], marks


def test_a_notice_during_the_restore_or_the_first_step_exits_75_at_once(tmp_path, reference):
    first = launch(tmp_path, "--steps", "6", "--eval-every", "4", "--eval-batches", "300")
    out, err = finish(first)
    assert first.returncode == 0, err
    for slow in (["--slow-load", "60"], ["--slow-first", "60"]):
        proc = launch(tmp_path, *STEPS, *slow)
        _, sent = signal_at(proc, "loading" if slow[0] == "--slow-load" else "first")
        out, err = finish(proc)
        waited = time.monotonic() - sent
        assert proc.returncode == 75, err
        assert "stop during the start" in err and waited < 15, (waited, err)
        assert Checkpointer(tmp_path / "ckpt").latest().step == 6  # nothing new trained, nothing saved
    resumed = launch(tmp_path, *STEPS)
    out, err = finish(resumed)
    assert resumed.returncode == 0, err
    assert digest_of(out) == reference
