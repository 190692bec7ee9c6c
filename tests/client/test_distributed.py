"""Distributed agreement: one rank's notice stops every rank at the same step.

A two-process gloo group tests :class:`Agreement` directly; torchrun runs the example with a
SIGUSR1 sent to ONE rank, and the resumed run must end bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
import torch.multiprocessing as mp

from spotguard.checkpoint import Checkpointer
from spotguard.distributed import Agreement, Decision

from _example import Proc, example_args, final, isolated_env


def test_without_a_process_group_the_local_decision_stands():
    agreement = Agreement()
    local = Decision(stop=True, checkpoint=False, seconds_left=12.0, save_seconds=1.0)
    assert not agreement.enabled and agreement.due(0)
    assert agreement.agree(0, local) is local


def _agree_worker(rank: int, init: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    agreement = Agreement(max_lag=0.5)
    out, step = [], 0
    for _ in range(6):
        while not agreement.due(step):
            step += 1
            time.sleep(0.002 if rank == 0 else 0.02)  # rank 1's steps look 10x slower
        local = Decision(stop=rank == 1 and step >= 3, checkpoint=rank == 0,
                         seconds_left=30.0 if rank == 0 else None,
                         save_seconds=0.5 if rank == 0 else 2.0, durable_seconds=None if rank == 0 else 7.5)
        marks = (step, float(rank == 1 and step >= 3))  # the same on both ranks, then rank 1's differs
        out.append((step, agreement.agree(step, local, marks), agreement.interval))
        step += 1
        time.sleep(0.002)
    results[rank] = out
    dist.destroy_process_group()


def test_two_ranks_agree_on_flags_deadline_save_cost_durable_time_interval_and_marks(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_agree_worker, args=(f"file://{tmp_path}/init", results), nprocs=2, join=True)
    assert results[0] == results[1]  # identical steps, decisions and intervals on both ranks
    for step, decision, interval in results[0]:
        assert decision.checkpoint  # rank 0 asked
        assert decision.seconds_left == 30.0 and decision.save_seconds == 2.0  # MIN, MAX
        assert decision.durable_seconds == 7.5  # the slowest node's time to durable (issue 28 item 2)
        assert decision.stop == (step >= 3)  # rank 1 asked, from step 3 on
        assert decision.marks_equal == (True, step < 3)  # every rank sees a mark that differs
        assert 1 <= interval <= 0.5 / 0.002  # never more than max_lag of the fastest rank


def torchrun(ckpt, steps: int, nproc: int, env, *extra: str) -> Proc:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *example_args(ckpt, steps, "--save-every", "15", *extra)]
    return Proc(argv, env)


def stop_one_rank(proc: Proc, nproc: int) -> int:
    """SIGUSR1 to the last rank only, once every rank trains; returns the agreed stop step."""
    def pids() -> dict[int, int]:  # ranks share one pipe: two prints may share a line
        return {int(m[1]): int(m[2]) for m in re.finditer(r"rank=(\d+) pid=(\d+) start", proc.output)}

    deadline = time.monotonic() + 60
    while len(pids()) < nproc and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids()) == nproc, proc.output
    time.sleep(0.5)
    os.kill(pids()[nproc - 1], signal.SIGUSR1)
    assert proc.finish(60) != 0  # torchrun reports the 75s as a failure
    stops = {int(m[1]): (int(m[2]), int(m[3])) for m in proc.grab(r"rank=(\d+) stopped step=(\d+) status=(\d+)")}
    assert sorted(stops) == list(range(nproc)), proc.output
    assert len(set(stops.values())) == 1, stops  # every rank at the same step, status 75
    step, status = stops[0]
    assert status == 75
    codes = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", proc.output, re.MULTILINE)
    assert codes == ["75"] * nproc, proc.output  # the processes really exited 75
    return step


@pytest.mark.slow
def test_notice_to_one_rank_stops_all_and_resume_is_exact(tmp_path):
    env = isolated_env(tmp_path / "rt")
    steps, args = 60, ("--step-sleep", "0.02")
    reference = torchrun(tmp_path / "ref", steps, 2, env)
    assert reference.finish(120) == 0, reference.output

    stopped = torchrun(tmp_path / "ckpt", steps, 2, env, *args)
    step = stop_one_rank(stopped, 2)
    assert 0 < step < steps
    assert Checkpointer(tmp_path / "ckpt").latest().step == step  # all ranks committed it

    resumed = torchrun(tmp_path / "ckpt", steps, 2, env, *args)
    assert resumed.finish(120) == 0, resumed.output
    assert resumed.grab(rf"rank=0 pid=\d+ start step={step}(?!\d)")
    assert final(resumed) == final(reference)


@pytest.mark.slow
def test_four_ranks_stop_together(tmp_path):
    proc = torchrun(tmp_path / "ckpt", 400, 4, isolated_env(tmp_path / "rt"), "--step-sleep", "0.02")
    step = stop_one_rank(proc, 4)
    assert Checkpointer(tmp_path / "ckpt").latest().step == step
