"""kill -9 at any instant of a save leaves a loadable checkpoint (the previous or the new one).

Each trial forks a real child that keeps saving in the background; the parent SIGKILLs it at a
random instant, or the child SIGKILLs itself right before/after a chosen system call of the commit
protocol (a write, an fsync, the rename, the ``latest`` replace), then the parent loads.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import time

import pytest
import torch

from spotguard.checkpoint import Checkpointer, emergency

N = 4096


def state_for(step: int) -> dict:
    return {"w": torch.full((N,), float(step)), "b": torch.full((3,), float(step)), "extras": {"step": step}}


def _kill_at(name: str, nth: int, after: bool) -> None:
    """SIGKILL this process right before/after the ``nth`` call of ``os.<name>``, counted once per
    call and atomically (an emergency save calls ``pwrite`` from several threads)."""
    real, calls = getattr(os, name), itertools.count(1)

    def hooked(*args, **kwargs):
        n = next(calls)
        if n == nth and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(*args, **kwargs)
        if n == nth and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(os, name, hooked)


def _child(root, first_step: int, hook: tuple | None, blocking: bool) -> None:
    try:
        torch.set_num_threads(1)
        emergency.SEGMENT_BYTES = 4096  # an emergency save writes the 16 KiB tensor from several threads
        ck = Checkpointer(root, keep=2, large_tensor_bytes=4096)
        if hook:
            _kill_at(*hook)
        deadline = time.monotonic() + 10
        step = first_step
        while time.monotonic() < deadline:
            ck.save(step, state_for(step), blocking=blocking)
            step += 1
    finally:
        os._exit(3)


def crash_once(root, first_step: int, hook: tuple | None, delay: float, blocking: bool) -> int:
    """Run a saving child until it is killed; returns its exit signal."""
    pid = os.fork()
    if pid == 0:
        _child(root, first_step, hook, blocking)
    if hook is None:
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)


HOOKS = [(name, nth, after) for name, nth in [("write", 1), ("write", 3), ("fsync", 2), ("rename", 1),
                                              ("rename", 2), ("replace", 1), ("replace", 2)]
         for after in (False, True)]


@pytest.mark.slow
def test_sigkill_at_any_instant_leaves_a_loadable_checkpoint(tmp_path, caplog):
    crash_trials(tmp_path, caplog, HOOKS, random.Random(1234), 24, blocking=False)


def crash_trials(tmp_path, caplog, hooks: list[tuple], rng: random.Random, kills: int, blocking: bool) -> None:
    """Crash a saving child at every hook, then ``kills`` times at random; load after each."""
    with Checkpointer(tmp_path, keep=2) as ck:
        started = time.perf_counter()
        ck.save(0, state_for(0), blocking=True)
        spread = max(0.08, 8 * (time.perf_counter() - started))  # a loaded machine saves slower
    trials = [(hook, 0.0) for hook in hooks] + [(None, rng.random()) for _ in range(kills)]
    last, next_step, steps_seen = 0, 1, set()
    for hook, share in trials:
        delay = share * spread
        assert crash_once(tmp_path, next_step, hook, delay, blocking) == signal.SIGKILL, hook
        caplog.clear()
        target = {"w": torch.zeros(N), "b": torch.zeros(3), "extras": {}}
        with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint"):
            info = Checkpointer(tmp_path, keep=2).load_latest(target)
        assert not caplog.records, [r.getMessage() for r in caplog.records]  # no torn checkpoint visible
        step = info.step
        assert step >= last, "a committed checkpoint was lost"
        assert target["extras"] == {"step": step}
        assert torch.equal(target["w"], torch.full((N,), float(step)))
        assert torch.equal(target["b"], torch.full((3,), float(step)))
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "stale dirs not cleaned"
        if hook is None and step == last:  # killed before it committed anything: a slow machine, so
            spread = min(2 * spread, 5.0)  # let later kills land further in (still at random instants)
        last, next_step = step, max(next_step, step) + 1
        steps_seen.add(step)
    assert len(steps_seen) > 10  # the kills really landed at many different points of progress
