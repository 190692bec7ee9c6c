"""``spotguard drill`` on DataLoader pipelines with workers: the README's passes, torch's fails.

examples/train_loader.py (``spotguard.DataLoader`` with two workers, shuffling, augmentation from
torch, NumPy and ``random``, dropout, AdamW, a warm-up + cosine LambdaLR) must survive every kind of
preemption bit for bit; the same kind of job over a plain ``torch.utils.data.DataLoader``
(drill_loader_job.py) must fail with a diagnosis naming the resume as what diverged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_drill_e2e import ROOT, drill, passed_every_kind


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dataloader_example_passes_every_kind_of_preemption(tmp_path):
    done = drill(tmp_path, "-n", "4", "--seed", "3", job=[
        sys.executable, str(ROOT / "examples" / "train_loader.py"), "--steps", "120",
        "--workers", "2", "--save-every", "10", "--step-sleep", "0.03", "--ckpt-dir", "ckpt"])
    report = passed_every_kind(tmp_path, done)
    # SIGTERM reaches the loader's workers too; a relaunch never resumes from the moved-aside
    # reference checkpoints (a daemon watching the working directory once uploaded, restored them)
    rows = report["preemptions"]
    assert all(row["steps_lost"] == 0 for row in rows if row["kind"] in ("notice", "sigterm"))
    assert all(row["resumed_from"] <= row["stopped_at"] for row in rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plain_torch_dataloader_fails_with_the_diverging_resume(tmp_path):
    done = drill(tmp_path, "-n", "1", "--seed", "1", job=[
        sys.executable, str(Path(__file__).with_name("drill_loader_job.py")), "--steps", "30",
        "--step-sleep", "0.1", "--ckpt-dir", "ckpt"])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED (identical): the final training state differs" in done.stderr
    assert "what diverges is the resume" in done.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert not report["passed"] and [row["kind"] for row in report["preemptions"]] == ["notice"]
