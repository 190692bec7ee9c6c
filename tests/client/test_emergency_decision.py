"""Run's deadline decision uses the emergency path's own cost: the state's bytes at the measured
emergency bandwidth. With the bandwidth injected (no timing in the test), a SIGTERM with a 30 s
deadline is followed by an emergency save exactly when expected seconds + the 2 s margin fit."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from spotguard.checkpoint import Checkpointer
from spotguard.guard import Guard
from spotguard.run import Run


def run_until_sigterm(root, expected_save_s: float) -> Run:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(daemon=False, force_exit=False, signal_deadlines={signal.SIGTERM: 30.0})
    run = Run(root, model=model, optimizer=optimizer, save_every=2, exit_on_stop=False, guard=guard)

    def at_step(step: int) -> None:
        if step == 4:  # a periodic save of step 4 committed; then the measured rate is injected
            run.checkpointer.wait()
            run.checkpointer.emergency.observe(10**6, 1.0)
            size = run.expected_save_seconds() * 10**6
            run.checkpointer.emergency.observe(size, expected_save_s)
            os.kill(os.getpid(), signal.SIGTERM)

    for step in run.steps(50):
        optimizer.zero_grad()
        model(torch.ones(2, 64)).sum().backward()
        optimizer.step()
        at_step(step)
    run.guard._restore_handlers()  # kept after a stop; this process goes on testing
    return run


@pytest.mark.parametrize("expected_save_s, saved", [(1.0, True), (26.0, True), (29.0, False), (300.0, False)])
def test_emergency_save_is_taken_exactly_when_it_fits(tmp_path, expected_save_s, saved):
    run = run_until_sigterm(tmp_path, expected_save_s)
    assert run.stopped and run.step == 5
    assert Checkpointer(tmp_path).latest().step == (5 if saved else 4)
    assert run.checkpointer.emergency.measured


def test_the_estimate_is_the_state_bytes_at_the_emergency_bandwidth(tmp_path):
    run = Run(tmp_path, model=torch.nn.Linear(64, 64), guard=Guard(daemon=False, force_exit=False))
    nbytes = run.expected_save_seconds() * 100e6  # nothing measured: the assumed 100 MB/s
    run.checkpointer.save(1, run.state, blocking=True)
    assert run.checkpointer.stats.bytes == pytest.approx(nbytes)
    assert run.expected_save_seconds() == pytest.approx(nbytes / run.checkpointer.emergency.bandwidth)
    run.close()
