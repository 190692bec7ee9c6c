"""A container's CPU quota bounds the persist's budget (spotguard.checkpoint._cgroup): read from a
real cgroup where this test may make one (root, a cpu controller), and from the files of both
layouts otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard.checkpoint._budget import BASELINE, SPARE_USE, Budget
from spotguard.checkpoint._cgroup import Quota, quota


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_v2_limit_and_usage(tmp_path):
    root = tree(tmp_path / "fs", {"kubepods/pod1/cpu.max": "150000 100000\n",
                                  "kubepods/pod1/cpu.stat": "usage_usec 2500000\nuser_usec 2000000\n"})
    proc = tree(tmp_path, {"cgroup": "0::/kubepods/pod1\n"}) / "cgroup"
    found = quota(root, proc)
    assert found is not None and found.cores == 1.5 and found.used() == 2.5
    (root / "kubepods/pod1/cpu.max").write_text("max 100000\n")
    assert quota(root, proc) is None  # no limit: the idle cores alone count


def test_v2_inside_a_container_reads_its_root(tmp_path):
    """With a cgroup namespace, /proc/self/cgroup says '0::/' and the pod's files are at the root."""
    root = tree(tmp_path / "fs", {"cpu.max": "200000 100000\n", "cpu.stat": "usage_usec 1000000\n"})
    proc = tree(tmp_path, {"cgroup": "0::/\n"}) / "cgroup"
    assert quota(root, proc).cores == 2


def test_v1_and_a_hybrid_layout(tmp_path):
    root = tree(tmp_path / "fs", {"cpu,cpuacct/job/cpu.cfs_quota_us": "300000\n",
                                  "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
                                  "cpu,cpuacct/job/cpuacct.usage": "4000000000\n",
                                  "unified/cgroup.procs": ""})
    proc = tree(tmp_path, {"cgroup": "0::/\n4:cpu,cpuacct:/job\n1:memory:/job\n"}) / "cgroup"
    found = quota(root, proc)
    assert found is not None and found.cores == 3 and found.used() == 4
    (root / "cpu,cpuacct/job/cpu.cfs_quota_us").write_text("-1\n")
    assert quota(root, proc) is None


@pytest.mark.parametrize("junk", ["", "garbage", "0::/x\n", "1:cpu:/missing\n"])
def test_unreadable_or_missing_files_mean_no_quota(tmp_path, junk):
    proc = tree(tmp_path, {"cgroup": junk}) / "cgroup"
    assert quota(tmp_path / "fs", proc) is None


def test_the_budget_takes_no_more_than_the_quota_leaves():
    """A pod limited to 2 cores on a node with 8 idle: the loop uses 1.5 of them, so half a core is
    spare, however idle the node."""
    clock = time.monotonic
    pod = Quota(2.0, lambda: 1.5 * clock())
    budget = Budget(0.25, cores=64, idle=lambda: 8 * clock(), cgroup=pod)
    for _ in range(BASELINE):
        time.sleep(0.02)
        budget.observe(0.02)
    assert budget.spare() == pytest.approx(0.5, rel=1e-2)
    assert budget.begin().share == pytest.approx(max(0.25, SPARE_USE * 0.5), rel=1e-2)


_CHILD = """
import json, os, sys, time
open(sys.argv[1] + "/cgroup.procs", "w").write(str(os.getpid()))
if len(sys.argv) > 2:
    open(sys.argv[2] + "/cgroup.procs", "w").write(str(os.getpid()))
from spotguard.checkpoint._cgroup import quota
found = quota()
used0 = found.used() if found else None
end = time.process_time() + 0.2
while time.process_time() < end:
    pass
print(json.dumps({"cores": found and found.cores, "used": found and used0 is not None and found.used() - used0}))
"""


def test_a_real_cgroup_with_a_quota(tmp_path):
    """A cgroup made here, with a quota of 1.5 cores: a process in it reads that quota and the CPU
    its cgroup uses."""
    v1_cpu, v1_acct, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpuacct"), Path("/sys/fs/cgroup")
    name = f"spotguard-test-{os.getpid()}"
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    made: list[Path] = []
    try:
        if (v1_cpu / "cpu.cfs_quota_us").exists():
            cpu = v1_cpu / name
            cpu.mkdir()
            made.append(cpu)
            (cpu / "cpu.cfs_period_us").write_text("100000")
            (cpu / "cpu.cfs_quota_us").write_text("150000")
            dirs = [cpu]
            if (v1_acct / "cpuacct.usage").exists() and v1_acct.resolve() != v1_cpu.resolve():
                made.append(acct := v1_acct / name)
                acct.mkdir()
                dirs.append(acct)
        elif (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
            made.append(cpu := v2 / name)
            cpu.mkdir()
            (cpu / "cpu.max").write_text("150000 100000")
            dirs = [cpu]
        else:
            pytest.skip("no cgroup cpu controller here")
        out = subprocess.run([sys.executable, "-c", _CHILD, *map(str, dirs)], capture_output=True, text=True,
                             timeout=60, check=True)
        result = json.loads(out.stdout)
        assert result["cores"] == 1.5
        assert 0.15 <= result["used"] <= 1.0  # the 0.2 s of CPU it burnt, counted by its cgroup
    finally:
        for directory in reversed(made):
            for _ in range(50):  # the child has exited; its cgroup empties a moment later
                try:
                    directory.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)
