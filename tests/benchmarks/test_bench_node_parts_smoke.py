"""Smoke test of ``bench_node_parts.py --quick`` (real moto_server, real uploads and restores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_node_parts.py"

pytestmark = pytest.mark.slow


def test_node_parts_quick(tmp_path):
    out = tmp_path / "parts.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert results["global_commit"]["n"] == 2 and results["shared_commit"]["n"] == 2
    # 2 nodes x 2 ranks, 1 MiB a part: the fresh node fetches its 2 parts and rank 0's, not all 4
    assert (results["fresh_own_bytes"], results["fresh_whole_bytes"]) == (3 << 20, 4 << 20)
