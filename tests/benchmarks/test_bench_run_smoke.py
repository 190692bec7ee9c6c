"""Smoke test of bench_run.py: the real script, tiny parameters, plausibility checks only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


def test_run_quick(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_run.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    for name in ("supervised", "shell_loop"):
        assert results[name]["gap_ms"]["n"] == 5 and results[name]["gap_ms"]["max_ms"] < 60_000
        assert results[name]["footprint"]["rss_samples"] >= 1
    assert "| supervised | 5 |" in proc.stdout
