"""Smoke tests of ``bench_peer.py --quick`` (a real peer server, real pushes and fetches; on loopback and
over a shaped veth pair) and ``bench_peer_inflation.py --quick``.
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
    assert results["mb"] == 16 and set(results["medians"]) == {"raw_link_s", "dd_write_s", "push_s", "fetch_s",
                                                                  "bucket_restore_s"}
    assert all(v > 0 for v in results["medians"].values()) and "of the raw link" in proc.stdout


def test_peer_quick_over_a_shaped_link_between_namespaces(tmp_path):
    """``--link-mbit``: the same copy between two namespaces over a veth pair shaped with ``tc``."""
    sys.path.insert(0, str(BENCH.parents[1] / "tests" / "multinode"))
    from _twonodes import netns_available

    why = netns_available()
    if why:
        pytest.skip(f"MULTI-NODE TESTS SKIPPED: {why}")
    out = tmp_path / "peer-link.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--link-mbit", "800", "--dir", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert results["link_mbit"] == 800 and "shaped to 800 Mbit/s" in proc.stdout
    # 800 Mbit/s is 100 MB/s: the shaped link, not the disk or the CPU, bounds the raw copy
    assert results["rates"]["raw_link_mb_s"] < 110, results


def test_peer_inflation_quick(tmp_path):
    """``bench_peer_inflation.py --quick``: two real daemons, a copy per round, a training loop's steps."""
    out = tmp_path / "peer_inflation.json"
    proc = subprocess.run([sys.executable, str(BENCH.with_name("bench_peer_inflation.py")), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert results["rounds"] == 2 and len(results["per_round"]) == 2 and results["steps_copying"] > 0
    assert "inflation" in proc.stdout
