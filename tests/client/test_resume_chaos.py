"""Chaos on the pipeline people run: a shuffled ``spotguard.DataLoader`` with two workers, random
augmentation (torch, NumPy, ``random``) in the dataset, dropout, AdamW, a lambda LR schedule and
gradient clipping, SIGKILLed at 6 random instants and relaunched each time with the identical
command. Judged from the run record alone: every life resumed from a committed checkpoint at or
after the newest one committed before it, no checkpoint was skipped as corrupt, and the final state
digest equals an uninterrupted run's.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from _jobserver import JobServer
from spotguard import _record
from test_resume_matrix import JOB, job_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, KILLS, KILL_WITHIN = 300, 6, 0.3
"""A life trains at most KILL_WITHIN s after its first step, 30 steps of >= 10 ms: 6 lives (180
steps) can never finish the job. (6, not more: on CPython 3.11.7 each life's two workers start from
a forkserver, whose start imports torch, seconds a life (see spotguard._fork);
tests/client/test_chaos.py kills 20 lives of a loader without workers.)"""
FLAGS = ["--workers", "2", "--save-every", "2", "--step-sleep", "0.01"]


def argv(ckpt: Path) -> list[str]:
    return [JOB, "--ckpt-dir", str(ckpt), "--steps", str(STEPS), *FLAGS]


def test_sigkill_at_random_instants_on_a_loader_with_workers(tmp_path):
    server, rng = JobServer(), random.Random(7)
    record, ckpt, out = tmp_path / "chaos.record", tmp_path / "ckpt", tmp_path / "life.out"
    try:
        kills = 0
        while kills < KILLS:
            pid = server.start(argv(ckpt), job_env(record), out)
            wait_for_training(record, kills + 1)
            threading.Event().wait(rng.uniform(0.0, KILL_WITHIN))
            os.kill(pid, signal.SIGKILL)
            rc = server.wait()
            assert rc in (0, -signal.SIGKILL), out.read_text()
            assert rc == -signal.SIGKILL, f"the job ended before its {kills + 1}th kill"
            kills += 1
        assert server.run(argv(ckpt), job_env(record), out) == 0, out.read_text()
        assert server.run(argv(tmp_path / "ref"), job_env(tmp_path / "ref.record"), out) == 0
    finally:
        server.close()
    events = list(_record.read(record))
    check_lives(events)
    final = [e["digest"] for e in events if e["event"] == "finish"]
    reference = [e["digest"] for e in _record.read(tmp_path / "ref.record") if e["event"] == "finish"]
    assert final == reference and len(final) == 1


def wait_for_training(record: Path, life: int, timeout: float = 60.0) -> None:
    """Until the ``life``-th start is followed by a step's data: the life has loaded, its loader's
    workers have started (from a forkserver, seconds on CPython 3.11.7) and it trains."""
    deadline = time.monotonic() + timeout
    while True:
        events = [e["event"] for e in _record.read(record)]
        starts = [i for i, event in enumerate(events) if event == "start"]
        if len(starts) >= life and "data" in events[starts[life - 1]:]:
            return
        assert time.monotonic() < deadline, f"life {life} did not train within {timeout:.0f} s"
        time.sleep(0.01)


def check_lives(events: list[dict]) -> None:
    """Every start resumed at or after the newest commit recorded before it; none skipped one."""
    newest, starts = 0, []
    for event in events:
        if event["event"] == "commit":
            newest = max(newest, event["step"])
        elif event["event"] == "start":
            assert not event["skipped"], event
            resumed = event["resumed_from"] or 0
            assert resumed >= newest, f"resumed at {resumed}, but step {newest} was committed"
            starts.append(resumed)
    assert len(starts) == KILLS + 1 and starts[-1] > 0 and starts == sorted(starts), starts
    print("chaos starts:", starts)  # shown with -s
