"""Smoke test of bench_multinode.py: one notice on a real two-namespace, two-daemon, two-agent job.

Root only (``ip netns``); skips loudly otherwise. Figures are checked only for plausibility.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_multinode.py"

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_bench_multinode_quick(tmp_path):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("MULTI-NODE BENCHMARK SKIPPED: needs root and the ip command (ip netns)")
    out = tmp_path / "multinode.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    (notice,) = json.loads(out.read_text())["notice"]
    assert notice["stopped_ranks"] == notice["ranks"] == 4 and len(notice["stop_steps"]) == 1
    assert notice["exit_codes"] == [75]
    assert 0 < notice["notice_to_all_stopped_s"] < notice["deadline_s"]
    assert "| notice deadline s |" in proc.stdout
