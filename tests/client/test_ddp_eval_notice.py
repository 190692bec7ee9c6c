"""The Lightning and Hugging Face callbacks and a notice during a validation or evaluation inside
``fit``/``train()`` under DDP (torchrun, 2 ranks, gloo).

Lightning (``Trainer(strategy="ddp")``, its sanity check on): rank 1 alone gets SIGTERM 5 batches into the 2 s validation after step 4 (the next periodic save
would be step 5). The ranks agree at a validation batch's end (the callback's ``run.heartbeat()``,
``agree_at_heartbeat``), both save step 4 with the state kept when the validation began (Lightning's
dict, data position, RNG) and exit 75 without finishing the validation; the relaunch runs that
validation again and ends on the uninterrupted run's digest. The Hugging Face ``Trainer`` the same way, at its prediction steps
(``checkpoint-4`` written by the Trainer on both ranks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import test_heartbeat_notice as heartbeat
from spotguard.checkpoint import Checkpointer

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("_lightning_ddp_eval_job.py")
HF_JOB = Path(__file__).with_name("_hf_ddp_eval_job.py")


def reference_then_stop(tmp_path: Path, job: Path) -> tuple[str, Path, str]:
    """The uninterrupted run's digest, then a run with rank 1's SIGTERM during the evaluation after
    step 4 that both ranks end with 75: (digest, its directory, its output)."""
    status, text, codes = heartbeat.torchrun(tmp_path / "reference", tmp_path, job)
    assert status == 0 and codes == {0: "0", 1: "0"}, text[-6000:]
    reference = heartbeat.digest_of(text)
    out = tmp_path / "stopped"
    status, text, codes = heartbeat.torchrun(out, tmp_path, job, JOB_SIGNAL_EVAL="4")
    assert codes == {0: "75", 1: "75"}, (codes, text[-6000:])
    assert (out / "signalled").exists()
    return reference, out, text


@pytest.mark.timeout(600)
def test_a_notice_to_one_rank_during_a_ddp_validation_stops_both_ranks_with_that_step_saved(tmp_path):
    reference, out, text = reference_then_stop(tmp_path, JOB)
    agreed = re.findall(r"^\[rank (\d)\] .*a stop agreed at run.heartbeat\(\) \d+, between steps: every rank "
                        r"saves step (\d+)$", text, re.M)
    assert sorted(agreed) == [("0", "4"), ("1", "4")], text[-6000:]
    assert text.count("validating 4") == 2 and "validated 4" not in text  # stopped during the validation
    assert Checkpointer(out / "ckpt").latest().step == 4  # the stop's own save (periodic: every 5)
    assert text.count("Traceback") == text.count("errors.ChildFailedError:"), text[-6000:]  # torchrun's own

    status, text, codes = heartbeat.torchrun(out, tmp_path, JOB)
    assert status == 0 and codes == {0: "0", 1: "0"}, text[-6000:]
    # the validation the stop cut short runs again from its start (Lightning's restart would count
    # it done), on both ranks, and changes nothing the training sees
    assert "resumed from step 4" in text and text.count("validated 4") == 2
    assert heartbeat.digest_of(text) == reference


@pytest.mark.timeout(600)
def test_a_notice_to_one_rank_during_a_ddp_evaluation_in_the_hf_trainer_stops_both_ranks_with_that_step_saved(
        tmp_path):
    pytest.importorskip("transformers")
    reference, out, text = reference_then_stop(tmp_path, HF_JOB)
    saved = re.findall(r"^\[rank (\d)\] .*stopping at step (\d+): emergency save during the evaluation", text, re.M)
    assert sorted(saved) == [("0", "4"), ("1", "4")], text[-6000:]  # rank 0 had no notice: agreed
    assert text.count("evaluating 4") == 2 and "evaluated 4" not in text
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]  # periodic: every 5
    assert {p.name for p in (out / "checkpoint-4").glob("rng_state*")} == {"rng_state_0.pth", "rng_state_1.pth"}

    status, text, codes = heartbeat.torchrun(out, tmp_path, HF_JOB)
    assert status == 0 and codes == {0: "0", 1: "0"}, text[-6000:]
    assert "resumed from step 4" in text and "evaluating 4" not in text
    assert heartbeat.digest_of(text) == reference
