"""Smoke test of bench_detection.py: the real script, tiny parameters, plausibility checks only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


def test_detection_quick(tmp_path):
    out = tmp_path / "detection.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_detection.py"), "--out", str(out),
                           "--repeats", "1", "--failures", "2", "--log-seconds", "3",
                           "--platforms", "azure,aws", "--modes", "503,garbage"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    for variant in ("bounded", "baseline"):
        assert sorted(data["results"][variant]) == ["aws/503", "aws/garbage", "azure/503", "azure/garbage"]
        for key, stats in data["results"][variant].items():
            assert stats["errors"] == [] and stats["n"] == 1, (variant, key, stats)
            assert 0 <= stats["max_ms"] < 60_000
    assert set(data["log_lines_per_minute"]) == {"aws/503", "aws/garbage", "azure/503", "azure/garbage"}
    assert "| azure | 503 | 1 |" in proc.stdout
