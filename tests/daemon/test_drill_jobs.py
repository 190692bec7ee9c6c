"""``spotguard drill`` on the jobs the README describes beyond a plain ``Run`` loop: a three-rank
``torchrun`` DDP job, the Lightning callback and the Hugging Face Trainer callback. Each correct
job passes after a preemption that took effect; the DDP job that hands ``Run`` its bare module
(the bucket layout then left wrong on resume) fails with the arithmetic named, not missing state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_drill_e2e import drill

HERE = Path(__file__).parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def report_of(tmp_path) -> dict:
    return json.loads((tmp_path / "report" / "report.json").read_text())


def passed_with_an_effective_preemption(tmp_path, done) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    report = report_of(tmp_path)
    assert report["verdict"] == "PASSED" and report["effective_preemptions"] == 1
    assert all(check["ok"] for check in report["checks"])
    assert report["launches"][-1]["resumed_from"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bare", [True, False], ids=["bare-module", "ddp"])
def test_a_3_rank_ddp_job_fails_naming_the_bucket_layout_only_when_run_lacks_its_ddp(tmp_path, bare):
    done = drill(tmp_path, "-n", "1", "--seed", "1", job=[
        TORCHRUN, "--nproc-per-node", "3", str(HERE / "drill_ddp_job.py"), "--ckpt-dir", "ckpt",
        *(["--bare"] if bare else [])])
    if not bare:
        passed_with_an_effective_preemption(tmp_path, done)
        return
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED (identical): the final training state differs" in done.stderr
    assert "trains through a DistributedDataParallel that Run was not given" in done.stderr
    assert "The arithmetic of the resumed steps differs (DDP bucket layout, reduction order)" in done.stderr
    assert "pass every stateful object" not in done.stderr
    failed = {check["name"] for check in report_of(tmp_path)["checks"] if not check["ok"]}
    assert failed == {"identical"}  # state, data, RNG streams, step and LR all went on exactly
    assert report_of(tmp_path)["effective_preemptions"] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_a_lightning_or_hf_trainer_job_passes(tmp_path, framework):
    done = drill(tmp_path, "-n", "1", "--seed", "1", job=[
        sys.executable, str(HERE / "drill_framework_job.py"), framework, "--out", "out"])
    passed_with_an_effective_preemption(tmp_path, done)
    checks = {check["name"]: check for check in report_of(tmp_path)["checks"]}
    assert {"identical", "preemptions", "rng streams", "step"} <= set(checks)
    if framework == "lightning":  # its default ModelCheckpoint wrote into the same directory twice
        assert "but for the names of Lightning's checkpoint files" in checks["identical"]["detail"]
