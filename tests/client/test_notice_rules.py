"""The notice rules with the real daemon (a subprocess) and a real training loop (a subprocess):
a cancel lets training finish, a far deadline keeps training then stops in time, a daemon restart
(upgrade) does not stop training while a node shutdown does, a finished job relaunched under a
pending notice exits 0, and a commit made while the daemon was down is still made durable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from spotguard.checkpoint import Checkpointer
from spotguard.protocol import Kind, NotifyRequest, StatusRequest

pytestmark = pytest.mark.slow

TRAIN = textwrap.dedent("""
    import json, os, sys, threading, time
    from pathlib import Path
    import torch
    from spotguard.run import Run
    ckpt, total, step_s, stop_lead, gate = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \\
        float(sys.argv[4]), sys.argv[5]

    def train():
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = Run(ckpt, model=model, optimizer=opt, save_every=10, stop_lead=stop_lead,
                  on_commit=lambda info: print("commit", info.step, flush=True))
        seen = None
        import atexit
        atexit.register(lambda: print("exiting", time.time(), flush=True))
        for step in run.steps(total):
            notice = run.guard.notice
            if notice is not None and seen is None:
                seen = notice.id
                print("notice", json.dumps({"id": notice.id, "deadline": notice.deadline.timestamp()
                                            if notice.deadline else None, "step": step}), flush=True)
            if notice is None and seen is not None:
                print("cleared", step, flush=True)
                seen = ""
            if step == 12 and gate != "-":
                print("gated", flush=True)
                while not Path(gate).exists():
                    time.sleep(0.05)
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            time.sleep(step_s)
        run.finish()
        print("finished", run.step, flush=True)

    if os.environ.get("TRAIN_IN_THREAD") == "1":  # Ray Train, a notebook, a server: no signal handler
        ended = []
        def body():
            try:
                train()
            except SystemExit as exc:
                ended.append(exc.code)
        worker = threading.Thread(target=body)
        worker.start()
        worker.join()
        sys.exit(ended[0] if ended else 0)
    train()
""")


class Trainer:
    """The training script as a subprocess; its stdout lines are read on demand."""

    def __init__(self, tmp: Path, daemon, total: int, *, step_s: float = 0.05, stop_lead: float = 60.0,
                 gate: str = "-", ckpt: Path | None = None, env_extra: dict[str, str] | None = None) -> None:
        script = tmp / "train_rules.py"
        script.write_text(TRAIN)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env.update(SPOTGUARD_RUNTIME_DIR=str(daemon.runtime_dir), OMP_NUM_THREADS="1", **(env_extra or {}))
        self.ckpt = ckpt or daemon.checkpoint_root / "job"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(self.ckpt), str(total), str(step_s), str(stop_lead), gate],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []

    def wait_line(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.strip())
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"no {prefix!r} line; got {self.lines[-5:]}: {self.finish(5)[1][-3000:]}")

    def finish(self, timeout: float = 60.0) -> tuple[int, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        self.lines += out.splitlines()
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def trainers():
    started: list[Trainer] = []

    def make(*args, **kwargs) -> Trainer:
        started.append(Trainer(*args, **kwargs))
        return started[-1]

    yield make
    for trainer in started:
        trainer.kill()


def aws_daemon(daemon_factory, url: str):
    return daemon_factory("--platform", "aws", env={
        "SPOTGUARD_AWS__ENDPOINT": url, "SPOTGUARD_AWS__INTERVAL": "0.2",
        "SPOTGUARD_RUNNER__REQUEST_TIMEOUT": "1"})


def test_a_cancelled_notice_lets_training_finish_with_exit_0(daemon_factory, simulator, trainers, tmp_path):
    url = simulator("aws")
    daemon = aws_daemon(daemon_factory, url)
    trainer = trainers(tmp_path, daemon, 400)
    trainer.wait_line("commit 10")
    event = httpx.post(f"{url}/_sim/schedule", timeout=5,
                       json={"kind": "terminate", "in_seconds": 0.1, "deadline_seconds": 600}).json()
    notice = json.loads(trainer.wait_line("notice").split(" ", 1)[1])
    assert notice["deadline"] is not None  # the daemon's notice, not a local one from SIGUSR1
    httpx.post(f"{url}/_sim/cancel", json={"id": event["id"]}, timeout=5).raise_for_status()
    trainer.wait_line("cleared")
    assert "sent SIGUSR1 to 1 of 1" in daemon.output()  # the signal came, and added no notice
    code, err = trainer.finish()
    assert code == 0, err
    assert "finished 400" in trainer.lines


def test_a_run_made_in_a_thread_is_not_signalled_and_stops_on_the_notice(daemon_factory, trainers, tmp_path):
    """No signal handler outside the main thread: the client registers as not handling SIGUSR1,
    whose default action would kill it, so the daemon (default delivery: SIGUSR1 to registered
    clients) does not send it; the notice comes over ZeroMQ and the run saves and exits 75."""
    daemon = daemon_factory()
    trainer = trainers(tmp_path, daemon, 100000, env_extra={"TRAIN_IN_THREAD": "1"})
    trainer.wait_line("commit 10")
    clients = daemon.request(StatusRequest()).data["clients"]
    assert [c["signal"] for c in clients] == [False], clients
    daemon.request(NotifyRequest(kind=Kind.PREEMPT, deadline_seconds=30, detail="thread"))
    code, err = trainer.finish()
    assert code == 75, err
    assert "no signal handlers installed" in err and "sent SIGUSR1 to 0 of 0 processes" in daemon.output()
    stop_line = next(line for line in err.splitlines() if "stopping at step" in line)
    stop_step = int(stop_line.split("stopping at step ", 1)[1].split(":")[0].split(",")[0])
    assert Checkpointer(trainer.ckpt).latest().step == stop_step  # what it stopped at is committed


def test_a_far_deadline_keeps_training_then_stops_before_it(daemon_factory, trainers, tmp_path):
    daemon = daemon_factory()
    trainer = trainers(tmp_path, daemon, 100000, stop_lead=2.0)
    trainer.wait_line("commit 10")
    daemon.request(NotifyRequest(kind=Kind.PREEMPT, deadline_seconds=8, detail="far"))
    notice = json.loads(trainer.wait_line("notice").split(" ", 1)[1])
    code, err = trainer.finish()
    assert code == 75, err
    stopped_at = float(next(line for line in trainer.lines if line.startswith("exiting")).split()[1])
    stop_line = next(line for line in err.splitlines() if "stopping at step" in line)
    stop_step = int(stop_line.split("stopping at step ", 1)[1].split(":")[0].split(",")[0])
    assert stop_step > notice["step"] + 10, stop_line  # training went on after the notice
    assert stopped_at < notice["deadline"], err  # and stopped (saved, closed) before the deadline
    assert ("emergency save" in stop_line or "already saved" in stop_line) and "forced exit" not in err
    assert Checkpointer(trainer.ckpt).latest().step == stop_step  # what it stopped at is committed


@pytest.mark.parametrize("state, exit_code", [("running", 0), ("stopping", 75)])
def test_a_daemon_restart_keeps_training_and_a_node_shutdown_stops_it(daemon_factory, trainers, tmp_path,
                                                                      state, exit_code):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "systemctl"  # what systemd answers during an upgrade or a shutdown
    fake.write_text(f"#!/bin/sh\necho {state}\n")
    fake.chmod(0o755)
    daemon = daemon_factory(env={"INVOCATION_ID": "t", "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    trainer = trainers(tmp_path, daemon, 150, step_s=0.05)
    trainer.wait_line("commit 10")
    assert daemon.stop(signal.SIGTERM) == 0
    if state == "running":
        assert "the daemon stops, the node does not" in daemon.output()
        daemon.start()
    code, err = trainer.finish()
    assert code == exit_code, err
    assert ("finished 150" in trainer.lines) == (exit_code == 0)


def test_a_finished_job_relaunched_under_a_pending_notice_exits_0(daemon_factory, trainers, tmp_path):
    daemon = daemon_factory()
    first = trainers(tmp_path, daemon, 20, step_s=0.0)
    assert first.finish()[0] == 0
    daemon.request(NotifyRequest(kind=Kind.PREEMPT, deadline_seconds=40, detail="pending"))  # near
    again = trainers(tmp_path, daemon, 20, step_s=0.0)
    code, err = again.finish()
    assert code == 0, err
    assert "finished 20" in again.lines and "interruption notice" in err  # it saw the notice


def test_a_commit_made_while_the_daemon_was_down_is_announced_again(daemon_factory, trainers, tmp_path):
    store = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{store}"})
    gate = tmp_path / "go"
    trainer = trainers(tmp_path, daemon, 30, step_s=0.3, gate=str(gate))
    daemon.kill()  # SIGKILL: no goodbye; the client's next commit gets no answer
    trainer.wait_line("commit 10")
    trainer.wait_line("gated")
    daemon.start()
    deadline = time.monotonic() + 30
    durable = None
    while time.monotonic() < deadline and durable != 10:
        durable = ((daemon.request(StatusRequest()).data["uploads"]["durable"] or {}).get(
            _job_of(daemon)) or {}).get("step")
        time.sleep(0.2)
    assert durable == 10, daemon.output()[-3000:]
    gate.touch()
    code, err = trainer.finish()
    assert code == 0, err


def _job_of(daemon) -> str:
    durable = daemon.request(StatusRequest()).data["uploads"]["durable"] or {}
    return next(iter(durable), "default")
