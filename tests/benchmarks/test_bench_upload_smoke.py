"""Smoke test of the upload benchmark: ``bench_upload.py --quick`` runs for real (moto_server, the
daemon as a subprocess, a CommitRequest, a torch training loop) with a 32 MB checkpoint.

Figures are checked for plausibility only (this 2-core machine may be busy); what must hold
whatever the load is the structure of the results and the upload priority: with
``storage.upload_nice`` the daemon's upload threads run niced while its other threads do not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_upload.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, str]:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("bench") / "upload.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--nice", "0,10", "--out", str(out)],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_throughput_restore_and_finetune_figures(quick):
    data, _ = quick
    assert data["checkpoint_MB"] == 32 and data["files"] == 4
    assert all(value > 0 for value in data["upload"].values())
    assert data["restore"]["durable_restore_s"] > 0
    rows = data["finetune"]["checkpoints"]
    assert rows[0]["fraction_uploaded"] == 1.0 and rows[1]["fraction_uploaded"] < 0.5


def test_inflation_runs_the_real_daemon_on_both_backends(quick):
    data, stdout = quick
    result = data["step_time_inflation"]
    assert result["target_max_inflation_pct"] == 10 and result["checkpoint_MB"] == 32
    assert list(result["runs"]) == ["s3_nice0", "file_nice0", "s3_nice10", "file_nice10",
                                    "s3_nice10_emulator_nice19"]
    for name, run in result["runs"].items():
        assert run["steps_idle"] > 10 and run["steps_during_upload"] >= 1, (name, run)
        assert 0 < run["idle_p50_ms"] < 1000 and run["upload_s"] > 0 and run["daemon_cpu_s"] > 0
    assert result["runs"]["s3_nice0"]["emulator_cpu_s"] > 0, "the S3 upload must have reached moto"
    assert "| run | idle p50 ms | upload p50 ms | inflation % |" in stdout


def test_upload_threads_are_niced_and_the_notice_loop_is_not(quick):
    runs = quick[0]["step_time_inflation"]["runs"]
    for backend in ("s3", "file"):
        assert set(runs[f"{backend}_nice0"]["daemon_threads_by_nice"]) == {"0"}
        niced = runs[f"{backend}_nice10"]["daemon_threads_by_nice"]
        assert niced.get("10", 0) >= 2, niced  # the worker and at least one pool thread
        assert niced.get("0", 0) >= 1, niced  # the event loop keeps its priority
