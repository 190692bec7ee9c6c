"""Smoke tests of the daemon benchmarks: each script runs for real with tiny parameters.

They start the real simulator, daemon and subscriber processes, so a change to the daemon's CLI,
settings, socket layout or wire protocol that breaks a benchmark fails here instead of rotting
until the next full run. Figures are checked only for plausibility (this machine may be loaded).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _common import percentile, summarize  # noqa: E402

pytestmark = pytest.mark.slow


def run_script(name: str, out: Path, *args: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, str(BENCH / name), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([5.0], 99) == 5.0
    assert summarize([3.0, 1.0, 2.0]) == {"n": 3, "p50_ms": 2.0, "p99_ms": 3.0, "max_ms": 3.0, "mean_ms": 2.0}
    assert summarize([]) == {"n": 0}


def test_notice_latency_quick(tmp_path):
    data, stdout = run_script("bench_notice_latency.py", tmp_path / "nl.json", "--count", "2")
    results = data["results"]
    assert list(results) == ["aws", "gcp", "azure", "alibaba", "baseline_nth"]
    for name, result in results.items():
        assert "error" not in result, result
        assert result["missed"] == 0 and result["latency"]["n"] == 2 == len(result["samples_ms"])
        assert all(0 <= x < 5000 for x in result["samples_ms"]), (name, result["samples_ms"])
    assert results["gcp"]["latency"]["max_ms"] < 500, "the GCP long-poll must not wait for a poll"
    assert results["aws"]["target_ms"] == 1050 and results["gcp"]["target_ms"] == 50
    assert results["gcp"]["measured_alone"] and not results["aws"]["measured_alone"]
    assert "| gcp | long-poll | 2 |" in stdout


def test_fanout_quick(tmp_path):
    data, stdout = run_script("bench_fanout.py", tmp_path / "fo.json", "--subscribers", "3", "--notices", "3")
    assert list(data["results"]) == ["state_on_tmp", "state_on_tmpfs"]
    for results in data["results"].values():
        last, spread = results["last_after_publish_ms"], results["spread_ms"]
        assert last["n"] == 3 == spread["n"] and len(results["samples"]) == 3
        for sample in results["samples"]:
            assert 0 <= sample["spread_ms"] <= sample["last_after_publish_ms"] < 2000
    assert data["params"]["subscribers"] == 3 and "| state_on_tmp | last_after_publish_ms | 3 | 3 |" in stdout


def test_idle_quick(tmp_path):
    data, stdout = run_script("bench_idle.py", tmp_path / "idle.json", "--seconds", "2.5", "--warmup", "1.5")
    assert list(data["results"]) == ["aws", "aws_spot_only", "no_watcher"]
    aws, spot_only, none = data["results"].values()
    # Each watcher polls the spot path every second, the advisory paths every 5 s: a 2.5 s window on a
    # loaded machine may see as few as one poll of each, and the two runs are separate daemons, so their
    # counts are not ordered.
    assert aws["metadata_requests"] >= 1 and spot_only["metadata_requests"] >= 1, "the watchers must have polled"
    assert none["metadata_requests"] == 0
    for results in (aws, spot_only, none):
        assert 5 < results["rss_mb_min"] <= results["rss_mb_max"] < 1000
        assert 0 <= results["cpu_pct"] < 100 and results["window_s"] >= 2.5
    assert data["machine"]["cpus"] >= 1 and "CPU % of one core" in stdout
