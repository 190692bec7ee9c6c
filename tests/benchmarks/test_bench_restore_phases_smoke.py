"""Smoke test of bench_restore_phases.py on CPU: a tiny state, every phase timed, the results file
written. The figures are checked for plausibility only (this machine may be loaded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_phase_of_a_cpu_restore_is_timed(tmp_path):
    out = tmp_path / "phases.json"
    subprocess.run([sys.executable, "bench_restore_phases.py", "--gib", "0.01", "--dir", str(tmp_path),
                    "--out", str(out)], cwd=BENCH, check=True, capture_output=True, timeout=120)
    res = json.loads(out.read_text())
    arms = ["default", "uncapped", "default_again", "uncapped_again"]
    phases = ["read_entries_cold_s", "restore_from_buffers_s", *(f"load_latest_{arm}_s" for arm in arms)]
    assert res["device"] == "cpu" and all(res[p] > 0 for p in phases)
    assert all(res[f"load_latest_{arm}_page_faults"] >= 0 for arm in arms)
    assert "h2d_pinned_s" not in res  # the pinned yardsticks need CUDA state
    assert not list(tmp_path.glob("phases-*"))  # its scratch directory is gone


def test_the_pinned_read_arm_records_a_failure_and_puts_the_allocator_back(tmp_path):
    """With CUDA state the script measures reads into pinned buffers; where pinning fails (here: no
    CUDA) the error is recorded, the reader's own allocator is back, and nothing is raised."""
    sys.path.insert(0, str(BENCH))
    import bench_restore_phases as phases
    import torch

    from spotguard.checkpoint import Checkpointer, load

    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    with Checkpointer(tmp_path / "ck", keep=1) as ck:
        ck.save(1, state, blocking=True)
    path = next((tmp_path / "ck").glob("step-*"))
    original, res = load.aligned_bytes, {}
    phases.pinned_read(path, load.read_manifest(path), state, lambda name, fn: fn(), res)
    assert load.aligned_bytes is original
    if torch.cuda.is_available():
        assert "pinned_read_error" not in res
    else:
        assert "pinned_read_error" in res
