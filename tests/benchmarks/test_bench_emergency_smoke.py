"""Smoke test of bench_emergency.py: the real script (a fresh subprocess for the first save
included) at 32 MiB, one round; plausibility checks only, no timing targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


def test_emergency_quick(tmp_path):
    out = tmp_path / "emergency.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_emergency.py"), "--out", str(out), "--sizes",
                           "0.03125", "--repeats", "1", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = json.loads(out.read_text())["sizes"][0]
    assert row["size_bytes"] == (32 << 20) + 256 * 4096  # 16 MiB tensors + 256 small ones
    for key in ("dd_s", "torch_save_s", "emergency_s", "first_emergency_s", "periodic_path_s"):
        assert len(row["samples"][key]) == 1 and 0 < row[key] < 60, key
    assert row["emergency_bandwidth_mb_s"] > 0
    assert "| 0.03 GiB |" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["emergency.json"]  # scratch removed
