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


def test_node_parts_scale_costs_o_of_n(tmp_path):
    """Issue 28 item 9: N nodes' parts of one step cost about 8 requests per node; the node that
    completes the set reads node 0's part and no other (the global manifest names the parts); bytes
    read grow with N only by node 0's layout; retention reads each new part once and then an index."""
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--scale", "4", "32", "--backend", "file", "--retention",
                           "--out", str(out)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in json.loads(out.read_text())["results"]:
        n = row["nodes"]
        assert row["requests"] <= 9 * n + 4 and row["gets"] == 2 and row["global_writes"] == 1, row
        assert row["bytes_read"] < 1000 + 20 * n, row  # no part lists every rank's digest, nor is read twice
        (first, first_gets), (again, again_gets) = row["prunes"]
        assert first_gets <= n + 4 and first <= n + 20 and again_gets <= 4 and again <= 20, row
