"""Smoke test of ``bench_peer.py --quick`` (a real peer server on loopback, real pushes and fetches).
``bench_peer_loss.py`` needs two network namespaces and about 4 minutes; like ``bench_multinode.py
--node-local`` it has no smoke test, to keep the suite short (its path is the namespace test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_peer.py"

pytestmark = pytest.mark.slow


def test_peer_quick(tmp_path):
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert results["mb"] == 16 and set(results["medians"]) == {"raw_link_s", "push_s", "fetch_s", "bucket_restore_s"}
    assert all(v > 0 for v in results["medians"].values()) and "of the raw link" in proc.stdout
