"""The Lightning callback and a notice during a validation inside ``fit`` (real Trainer processes).

SIGTERM lands in the middle of a ~3 s validation after step 20 (between the periodic saves of 18
and 24). With room before the deadline the validation ends first and the stop comes at step 21's
end; with too little, the callback saves step 20's state as it was when the validation began and
ends ``fit`` with 75 without finishing it, and the relaunch runs that validation again. Either relaunch ends with the digest of an uninterrupted
run (the validation's RNG draws are put back at its end, so they never change training). A notice
whose deadline is far away lets the validation and training go on (``stop_lead``, as in ``Run``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spotguard._record import read
from spotguard.checkpoint import Checkpointer

from _example import isolated_env

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("_lightning_eval_job.py")


def job(out: Path, *args: str, **env: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, str(JOB), str(out), *args], capture_output=True, text=True,
                          env=isolated_env(out / "rt", **env), timeout=240)
    return proc.returncode, proc.stdout, proc.stderr


def digest(out: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith("DIGEST "))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    code, out, err = job(tmp_path_factory.mktemp("reference"))
    assert code == 0, err[-3000:]
    return digest(out)


def test_a_notice_during_validation_with_no_room_to_finish_it_saves_the_step_it_follows(tmp_path, reference):
    """SIGTERM 5 s from the kill: too close to finish the validation (3 s, as the one after step 8
    took), a step and the save, so the stop saves step 20's state from the validation's start."""
    record = str(tmp_path / "record.jsonl")
    code, out, err = job(tmp_path / "stopped", "20", SPOTGUARD_RECORD=record, SPOTGUARD_SIGNAL__GRACE="5")
    assert code == 75, err[-3000:]
    assert "spotguard stops during the validation after step 20" in err
    assert "emergency save" in err and "validating 20" in out and "DIGEST" not in out
    assert Checkpointer(tmp_path / "stopped" / "ckpt").latest().step == 20

    code, out, err = job(tmp_path / "stopped", SPOTGUARD_RECORD=record)
    assert code == 0, err[-3000:]
    assert "validating 8" not in out  # resumed after step 20
    assert "validating 20" in out  # the validation the stop cut short, run again from its start
    assert digest(out) == reference
    marks = {e["at"]: e["rng"] for e in read(record) if e["event"] == "marks" and e["step"] == 20}
    assert marks["save"] == marks["load"]  # the drill's marks digest the RNG saved, not the validation's


def test_a_stop_with_no_room_before_a_validation_resumes_into_it(tmp_path, reference):
    """SIGTERM 5 s from the kill inside step 20, which a validation follows: no room to wait, so the
    stop saves step 20 before it; the relaunch runs that validation (Lightning's restart would have
    counted it done) and the plateau scheduler steps on its metric as in a run never stopped."""
    code, out, err = job(tmp_path, JOB_TERM_IN_STEP="20", SPOTGUARD_SIGNAL__GRACE="5")
    assert code == 75, err[-3000:]
    assert "stopping at step 20" in err and "validating 20" not in out
    code, out, err = job(tmp_path)
    assert code == 0, err[-3000:]
    assert "validating 20" in out and digest(out) == reference


def test_a_notice_during_validation_with_room_waits_for_its_end_and_stops_after_the_next_step(
        tmp_path, reference):
    """SIGTERM 30 s from the kill (the default): the validation runs to its end (its effects on the
    callbacks' states are then in the checkpoint), and the stop comes at step 21's end."""
    code, out, err = job(tmp_path / "stopped", "20")
    assert code == 75, err[-3000:]
    assert "stops after the validation or epoch end that follows step 20" in err
    assert "stops during the validation" not in err and "DIGEST" not in out
    assert Checkpointer(tmp_path / "stopped" / "ckpt").latest().step == 21
    assert "validating 21" not in out  # Lightning's own validation after a stop: 3 s under the deadline

    code, out, err = job(tmp_path / "stopped")
    assert code == 0, err[-3000:]
    assert "validating 20" not in out  # it ran before the stop
    assert digest(out) == reference


def test_a_far_notice_during_validation_lets_training_go_on(tmp_path):
    code, out, err = job(tmp_path, "8", SPOTGUARD_SIGNAL__GRACE="100000")
    assert code == 0, err[-3000:]
    assert "training goes on" in err and "stops during the validation" not in err
    assert "validating 20" in out and Checkpointer(tmp_path / "ckpt").latest().step == 28
