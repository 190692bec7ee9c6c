"""Smoke test of bench_cadence_learning.py: the real script, one rate, 3 lives per policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


def test_cadence_learning_quick(tmp_path):
    out = tmp_path / "cadence.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_cadence_learning.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"learned", "guess", "oracle"}
    for r in results.values():
        assert r["lives"] == 3 and 0 < r["running_s"] and 0 <= r["waste"] <= 1
    assert results["oracle"]["final_mtbf_s"] == 1.0 and results["guess"]["final_mtbf_s"] == 8.0
    learned = [p for p in results["learned"]["trajectory"] if p]
    assert learned and all(p["source"] == "learned" for p in learned)
    # The MTBF each life held last (a life may be killed before its first commit): the third life
    # has seen two interruptions in a few seconds of running, which pull the guess (8 s) down:
    # (8 + running) / 3 < 8 while the lives ran under 16 s in all.
    held = results["learned"]["held"]
    assert results["learned"]["running_s"] < 16 and held[-1]["source"] == "learned", results["learned"]
    assert held[-1]["mtbf_s"] < 8.0, results["learned"]
    assert "| 1 | learned | 3 |" in proc.stdout
