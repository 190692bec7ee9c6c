"""Smoke test of bench_timeline.py: the real script, 3 rounds, plausibility checks only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


def test_timeline_quick(tmp_path):
    out = tmp_path / "timeline.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_timeline.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert results["outcomes"] == ["saved"] * 3
    for stage in ("published", "flagged", "stopped", "committed", "safe", "durable"):
        assert results[stage]["n"] == 3 and 0 <= results[stage]["max_ms"] < 60_000, stage
    assert results["published"]["max_ms"] <= results["durable"]["max_ms"]
    assert "| committed | 3 |" in proc.stdout
