"""The Hugging Face callback and a notice during an evaluation inside ``train()`` (real Trainer processes).

A notice whose deadline is far away lets the evaluation and training go on (``stop_lead``, as in
``Run``): that run is the uninterrupted reference. SIGTERM in the middle of the ~1.2 s evaluation
after step 16 (between the Trainer's saves of 12 and 18): the callback saves step 16 at once, with
the RNG states of the step (not the evaluation's draws), ends ``train()`` with 75 without finishing
the evaluation and records the stop; the relaunch ends with the reference's digest (an evaluation's
RNG draws are put back at its end, so they never change training)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spotguard._record import read

from _example import isolated_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("_hf_eval_job.py")


def job(out: Path, *args: str, **env: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, str(JOB), str(out), *args], capture_output=True, text=True,
                          env=isolated_env(out.parent / f"{out.name}-rt", **env), timeout=240)
    return proc.returncode, proc.stdout, proc.stderr


def digest(out: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith("DIGEST "))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """A far notice during the evaluation after step 8: training goes on to the end."""
    out = tmp_path_factory.mktemp("far") / "out"
    code, stdout, err = job(out, "8", SPOTGUARD_SIGNAL__GRACE="100000")
    assert code == 0, err[-3000:]
    assert err.count("training goes on") == 1 and "stops during the evaluation" not in err  # once a notice
    assert "evaluating 16" in stdout and (out / "checkpoint-20").is_dir()
    return digest(stdout)


def test_a_far_notice_during_an_evaluation_lets_training_go_on(reference):
    assert reference


def test_a_notice_during_an_evaluation_saves_the_step_and_resumes_bit_identically(tmp_path, reference):
    out, record = tmp_path / "out", str(tmp_path / "record.jsonl")
    code, stdout, err = job(out, "16", SPOTGUARD_RECORD=record)
    assert code == 75, err[-3000:]
    assert "spotguard stops during the evaluation after step 16" in err and "emergency save" in err
    assert "evaluating 16" in stdout and "evaluating 20" not in stdout and "DIGEST" not in stdout
    assert sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == [6, 12, 16]
    events = list(read(record))
    stop = next(e for e in events if e["event"] == "stop")
    assert stop["step"] == 16 and stop["save"] == "committed" and stop["saved"]
    assert stop["notice"]["kind"] == "signal"
    assert stop["flagged_t"] <= stop["stopped_t"] <= stop["committed_t"]
    assert [e["kind"] for e in events if e["event"] == "commit" and e["step"] == 16] == ["emergency"]

    code, stdout, err = job(out, SPOTGUARD_RECORD=record)
    assert code == 0, err[-3000:]
    assert "evaluating 8" not in stdout and "evaluating 20" in stdout  # resumed after step 16
    assert digest(stdout) == reference
