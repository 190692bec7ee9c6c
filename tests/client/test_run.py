"""spotguard.Run: resume, cadence saves, clean stops (SystemExit 75), advisory checkpoints,
commit reports, and the forced exit of a hung step (a real subprocess)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from spotguard.checkpoint import Checkpointer, CheckpointError
from spotguard.guard import Guard
from spotguard.run import Run, save_fits

from _example import isolated_env
from _fake_daemon import FakeDaemon, make_notice, wait_for


def parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


def train(run: Run, total: int, model, optimizer, hook=None) -> list[int]:
    ran = []
    for step in run.steps(total):
        ran.append(step)
        optimizer.zero_grad()
        model(torch.full((2, 8), float(step))).sum().backward()
        optimizer.step()
        if hook:
            hook(step)
    return ran


def quiet_guard(**kwargs) -> Guard:
    return Guard(daemon=kwargs.pop("daemon", False), force_exit=False, **kwargs)


@pytest.mark.parametrize("save, left, margin, fits", [
    (1.0, None, 2.0, True),    # no deadline: the watchdog bounds it anyway
    (None, 30.0, 2.0, False),  # unknown duration: skip
    (1.0, 30.0, 2.0, True),
    (1.0, 3.0, 2.0, False),    # 1 + 2 is not < 3
    (0.5, 3.0, 2.0, True),
])
def test_save_fits(save, left, margin, fits):
    assert save_fits(save, left, margin) is fits


def test_fresh_then_resume_after_the_last_committed_step(tmp_path):
    model, optimizer = parts()
    with Run(tmp_path, model=model, optimizer=optimizer, save_every=3, guard=quiet_guard()) as run:
        assert train(run, 7, model, optimizer) == list(range(7))
    assert Checkpointer(tmp_path).latest().step == 7  # finish() saved the final state
    weights = model.weight.detach().clone()

    model, optimizer = parts()
    with Run(tmp_path, model=model, optimizer=optimizer, save_every=3, guard=quiet_guard()) as run:
        assert train(run, 10, model, optimizer) == [7, 8, 9]
        assert run.resumed_from.step == 7 and run.start_step == 7
    model2, optimizer2 = parts()
    with Run(tmp_path / "straight", model=model2, optimizer=optimizer2, guard=quiet_guard()) as run:
        train(run, 10, model2, optimizer2)
    assert torch.equal(model.weight, model2.weight) and not torch.equal(model.weight, weights)


def test_spotguard_save_every_sets_the_default_cadence_only_and_the_record_says_whose(tmp_path, monkeypatch):
    """``spotguard drill`` gives its launches $SPOTGUARD_SAVE_EVERY: a Run given no cadence saves
    at that many steps, one given save_every keeps its own; the record's start says which, and
    whether the run listens to the daemon. A bad value is refused naming the variable."""
    from spotguard._record import read

    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("SPOTGUARD_RECORD", str(record))
    monkeypatch.setenv("SPOTGUARD_SAVE_EVERY", "3")
    for root, save_every in (("env", None), ("own", 4)):
        model, optimizer = parts()
        with Run(tmp_path / root, model=model, optimizer=optimizer, save_every=save_every,
                 daemon=False) as run:
            train(run, 9, model, optimizer)
    events = list(read(record))
    starts = [(e["cadence"], e["daemon"]) for e in events if e["event"] == "start"]
    assert starts == [("env", False), ("save_every", False)]
    assert [e["step"] for e in events if e["event"] == "commit" and e.get("kind") == "periodic"] == [3, 6, 9, 4, 8]
    monkeypatch.setenv("SPOTGUARD_SAVE_EVERY", "0")
    with pytest.raises(ValueError, match=r"\$SPOTGUARD_SAVE_EVERY must be a number of steps >= 1, got '0'"):
        Run(tmp_path / "bad", model=parts()[0], daemon=False)


def test_signal_stops_at_the_next_boundary_with_exit_75_and_finally_runs(tmp_path):
    model, optimizer = parts()
    previous = signal.getsignal(signal.SIGTERM)
    cleaned = []
    run = Run(tmp_path, model=model, optimizer=optimizer, save_every=100, guard=quiet_guard())
    with pytest.raises(SystemExit) as stop:
        try:
            train(run, 50, model, optimizer,
                  hook=lambda s: s == 4 and os.kill(os.getpid(), signal.SIGTERM))
        finally:
            cleaned.append(True)
    assert stop.value.code == 75 and cleaned
    assert run.stopped and run.step == 5
    assert Checkpointer(tmp_path).latest().step == 5  # 30 s default deadline: the save fits
    # the process is exiting: a late SIGTERM must not kill the teardown (the watchdog bounds it)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    run.guard._restore_handlers()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_exit_on_stop_false_ends_the_loop_instead(tmp_path):
    model, optimizer = parts()
    run = Run(tmp_path, model=model, optimizer=optimizer, exit_on_stop=False, save_every=100,
              guard=quiet_guard())
    ran = train(run, 50, model, optimizer, hook=lambda s: s == 2 and os.kill(os.getpid(), signal.SIGUSR1))
    run.guard._restore_handlers()  # kept after a stop (see above); this process goes on testing
    assert ran == [0, 1, 2] and run.stopped
    run.finish()  # a no-op after a stop
    assert Checkpointer(tmp_path).latest().step == 3


def test_a_save_due_at_a_held_boundary_is_taken_at_the_next_and_a_stop_is_not_held(tmp_path):
    """``hold_saves`` (a framework callback's: Lightning validates after this batch) moves a due
    save to the next boundary, never twice in a row; the cadence counts on from the save."""
    model, optimizer = parts()
    committed = []
    held = {3, 4, 10}  # boundaries, counted in steps done

    def hold(step):
        run.hold_saves = step + 1 in held

    with Run(tmp_path / "held", model=model, optimizer=optimizer, save_every=3, guard=quiet_guard(),
             on_commit=lambda info: committed.append(info.step)) as run:
        train(run, 12, model, optimizer, hook=hold)
    assert committed == [4, 7, 11, 12]  # 3 held (saved at 4, held again but not twice), 10 held

    model, optimizer = parts()
    run = Run(tmp_path / "stop", model=model, optimizer=optimizer, exit_on_stop=False, save_every=100,
              guard=quiet_guard())

    def stop_at_a_held_boundary(step):
        run.hold_saves = True
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    assert train(run, 50, model, optimizer, hook=stop_at_a_held_boundary) == [0, 1, 2]
    run.guard._restore_handlers()
    assert Checkpointer(tmp_path / "stop").latest().step == 3


def test_estimate_before_the_first_save_then_the_measured_cost(tmp_path):
    model, optimizer = parts()
    with Run(tmp_path, model=model, optimizer=optimizer, save_every=2, guard=quiet_guard()) as run:
        estimate = run.expected_save_seconds()
        assert estimate is not None and 0 < estimate < 0.01  # 144 bytes at 100 MB/s
        train(run, 3, model, optimizer)
        run.checkpointer.wait()
        stats = run.checkpointer.stats  # seeded by the periodic save's persist bandwidth
        assert run.expected_save_seconds() == pytest.approx(stats.persist_seconds)


@pytest.fixture
def daemon(tmp_path):
    fake = FakeDaemon(tmp_path / "rt").start()
    yield fake
    fake.stop()


def test_every_commit_is_reported_and_advisory_notices_checkpoint_early(tmp_path, daemon):
    model, optimizer = parts()
    guard = quiet_guard(daemon=True, pub_endpoint=daemon.pub_endpoint,
                        request_endpoint=daemon.request_endpoint)

    def hook(step):
        if step == 4:
            daemon.publish_notice(make_notice(900, terminating=False, kind="rebalance"))
            assert wait_for(lambda: guard.checkpoint_requested)

    with Run(tmp_path / "ckpt", model=model, optimizer=optimizer, save_every=3, guard=guard) as run:
        train(run, 8, model, optimizer, hook=hook)
        assert not run.stopped
    assert wait_for(lambda: len(daemon.requests_of("commit")) >= 3)
    # cadence at 3, the advisory notice at 5, cadence again 3 steps later at 8 (also the end)
    assert [c.step for c in daemon.requests_of("commit")] == [3, 5, 8]


HANG = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from spotguard.run import Run
    model = torch.nn.Linear(4, 4)
    run = Run(sys.argv[1], model=model, save_every=2,
              signal_deadlines={signal.SIGTERM: 3.0, signal.SIGUSR1: None})
    for step in run.steps(100):
        if step == 3:
            print("signalled", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)   # a collective whose peer is gone: the boundary is never reached
    print("not reached", flush=True)
""")


def test_forced_exit_76_when_a_step_hangs_after_a_notice(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt")],
                            env=isolated_env(tmp_path / "rt"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "signalled"
    started = time.monotonic()
    out, err = proc.communicate(timeout=30)
    elapsed = time.monotonic() - started
    assert proc.returncode == 76, err
    assert "not reached" not in out and "forced exit 76" in err
    # every thread's stack was dumped first: the user sees the line the main thread hung on
    hung_line = next(i for i, line in enumerate(HANG.splitlines(), 1) if "time.sleep(60)" in line)
    assert f'hang.py", line {hung_line} in <module>' in err and "spotguard-watchdog" not in out
    assert 0.5 < elapsed < 2.5  # 3 s deadline minus the 2 s margin
    assert Checkpointer(tmp_path / "ckpt").latest().step == 2  # the last commit is intact


def test_a_job_id_is_derived_from_the_command_and_directory_and_an_explicit_one_wins(tmp_path):
    from spotguard import _jobid

    one = _jobid.derive(["train.py", "--lr", "0.1"], "/work/a", {})
    assert one == _jobid.derive(["train.py", "--lr", "0.1"], "/work/a", {"SLURM_JOB_ID": "7"})  # requeue
    assert one.startswith("train-")
    others = {_jobid.derive(["train.py", "--lr", "0.2"], "/work/a", {}),
              _jobid.derive(["train.py", "--lr", "0.1"], "/work/b", {}),
              _jobid.derive(["train.py", "--lr", "0.1"], "/work/a", {"SLURM_ARRAY_TASK_ID": "3"})}
    assert one not in others and len(others) == 3
    with Run(tmp_path, model=torch.nn.Linear(2, 2), guard=quiet_guard(), job_id="mine") as run:
        assert run.job_id == "mine" and run.checkpointer.job_id == "mine"
    with Run(tmp_path, model=torch.nn.Linear(2, 2), guard=quiet_guard()) as run:
        assert run.job_id == _jobid.derive() and run.checkpointer.job_id == run.job_id


def test_a_checkpoint_of_another_model_is_refused_with_the_fix(tmp_path):
    model, optimizer = parts()
    with Run(tmp_path, model=model, optimizer=optimizer, guard=quiet_guard()) as run:
        train(run, 3, model, optimizer)
    other = torch.nn.Linear(16, 4)  # different shapes: load_state_dict cannot take it
    with pytest.raises(CheckpointError, match="does not fit this run.*size mismatch.*own checkpoint root"):
        Run(tmp_path, model=other, guard=quiet_guard()).steps(5).__next__()
    renamed = {"net": torch.nn.Linear(8, 4)}  # different entries: nothing of it would be restored
    with pytest.raises(CheckpointError, match=r"holds \['model', 'optimizer'\], this run has \['net'\]"):
        Run(tmp_path, state=renamed, guard=quiet_guard()).steps(5).__next__()
