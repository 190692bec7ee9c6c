"""A rank whose peer vanished in the agreement exits ``EXIT_PEER_LOST`` (77) within ``peer_timeout``.

Two real processes in one gloo group run a ``spotguard.Run`` loop with no collective of their own,
so the library's per-step agreement is where a lost peer is waited for. The test stops rank 1
(SIGSTOP): there but silent, as a node that dropped off the network is (no connection reset ever
arrives: torch's default would wait 30 minutes). Rank 0's agreement gives up after ``peer_timeout``
and it exits 77 cleanly, saying why, with a ``peer_lost`` record. The other path, a collective of the
step itself (DDP's all-reduce) ended by the progress watchdog, is what the two-node kill test
(test_multinode_kill.py) runs into.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard import _record
from spotguard.exit_codes import EXIT_PEER_LOST
from spotguard.run import PEER_LOST_GRACE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # torchrun start-up on a loaded CI

JOB = Path(__file__).with_name("_peer_job.py")
PEER_TIMEOUT = 2.0
BOUND = PEER_TIMEOUT + PEER_LOST_GRACE + 15  # + the exit itself, on a loaded machine


def start(tmp_path: Path, rank: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "SPOTGUARD_RECORD": str(tmp_path / "record.jsonl"), "PYTHONUNBUFFERED": "1"}
    env.pop("SPOTGUARD_RUNTIME_DIR", None)
    argv = [sys.executable, str(JOB), "--rank", str(rank), "--init", f"file://{tmp_path}/init",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--peer-timeout", str(PEER_TIMEOUT), *extra]
    with open(tmp_path / f"rank{rank}.log", "wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for_training(tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 120
    record = tmp_path / "record.jsonl"
    while not any(e["event"] == "progress" and e["step"] >= 3 for e in _record.read(record)):
        assert all(p.poll() is None for p in procs), logs(tmp_path)
        assert time.monotonic() < deadline, logs(tmp_path)
        time.sleep(0.05)


def logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(tmp_path.glob("rank*.log")))


def test_a_rank_whose_peer_vanished_in_the_agreement_exits_77_within_peer_timeout(tmp_path):
    procs = [start(tmp_path, rank) for rank in (0, 1)]
    try:
        wait_for_training(tmp_path, procs)
        os.kill(procs[1].pid, signal.SIGSTOP)  # silent, as a node gone from the network
        try:
            code = procs[0].wait(BOUND)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank 0 still runs {BOUND} s after its peer vanished:\n{logs(tmp_path)}")
        assert code == EXIT_PEER_LOST, logs(tmp_path)
        output = (tmp_path / "rank0.log").read_text(errors="replace")
        lost = [e for e in _record.read(tmp_path / "record.jsonl") if e["event"] == "peer_lost"]
        assert [e["rank"] for e in lost] == [0], logs(tmp_path)  # the clean path, not the watchdog
        assert "a peer rank is gone or unreachable" in output and "exiting 77" in output
        assert "forced exit" not in output
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def test_long_work_with_heartbeats_and_work_after_the_loop_are_not_a_lost_peer(tmp_path):
    """The progress bound must not fire on a healthy job: an evaluation inside a step that calls
    ``run.heartbeat()``, and work after the loop (no boundary comes any more), each longer than
    ``peer_timeout + PEER_LOST_GRACE``."""
    long = str(PEER_TIMEOUT + PEER_LOST_GRACE + 1)
    procs = [start(tmp_path, rank, "--steps", "6", "--evaluate-at", "2", "--evaluate-for", long,
                   "--after-loop", long) for rank in (0, 1)]
    try:
        codes = [proc.wait(BOUND * 4) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert codes == [0, 0], logs(tmp_path)
    assert "forced exit" not in logs(tmp_path)
