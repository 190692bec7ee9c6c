"""Smoke test of bench_fork_stall.py: both arms run with real forks, the results file is written.
The figures are not judged here (this machine may be loaded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_both_arms_time_a_save_with_and_without_a_forked_child(tmp_path):
    out = tmp_path / "fork_stall.json"
    done = subprocess.run([sys.executable, "bench_fork_stall.py", "--gib", "0.125", "--rounds", "1", "--dir",
                           str(tmp_path), "--out", str(out)], cwd=BENCH, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    assert set(res["medians"]) == {"private", "shared"}
    assert all(m["stall_s"] > 0 and m["stall_after_fork_s"] > 0 for m in res["medians"].values())
    assert "| shared |" in done.stdout and not list(tmp_path.glob("forkstall-*"))
