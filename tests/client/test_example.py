"""examples/train_plain.py end to end: resume, SIGTERM with and without time, daemon notices."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from spotguard.checkpoint import Checkpointer

from _example import Proc, final, isolated_env, run_to_end
from _fake_daemon import FakeDaemon, make_notice, wait_for

pytestmark = pytest.mark.slow  # each test launches the example (torch start-up) once or twice

STEPS = 120


def committed_step(ckpt) -> int | None:
    info = Checkpointer(ckpt).latest()
    return None if info is None else info.step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(checkpoint root, final digest) of an uninterrupted run of STEPS steps."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = run_to_end(tmp / "ckpt", STEPS, "--save-every", "50", env=isolated_env(tmp / "rt"))
    assert final(proc)[0] == STEPS
    return tmp / "ckpt", final(proc)[1]


@pytest.fixture
def reference(uninterrupted):
    return uninterrupted[1]


def test_rerunning_a_finished_run_resumes_at_the_end_with_the_same_digest(tmp_path, uninterrupted):
    ckpt, digest = uninterrupted
    again = run_to_end(ckpt, STEPS, "--save-every", "50", env=isolated_env(tmp_path / "rt"))
    assert final(again) == (STEPS, digest)
    assert not again.grab(r"start step=")  # nothing left to train


def stop_with(proc: Proc, sig: int, after: float) -> int:
    proc.wait_line(r"start step=")
    time.sleep(after)
    proc.popen.send_signal(sig)
    return proc.finish(30)


def test_sigterm_with_time_saves_at_the_stop_step_exits_75_and_resumes_exactly(tmp_path, reference):
    env, ckpt = isolated_env(tmp_path / "rt"), tmp_path / "ckpt"
    args = ("--save-every", "1000", "--step-sleep", "0.01")
    proc = Proc.example(ckpt, STEPS, *args, env=env)
    assert stop_with(proc, signal.SIGTERM, 0.4) == 75, proc.output
    (stopped,) = proc.grab(r"stopped step=(\d+) status=75")
    step = int(stopped[1])
    assert 0 < step < STEPS
    assert committed_step(ckpt) == step  # the emergency save is the stop step itself
    resumed = run_to_end(ckpt, STEPS, *args[:2], env=env)
    assert resumed.grab(rf"start step={step}\b")
    assert final(resumed) == (STEPS, reference)


def test_sigterm_without_time_skips_the_save_and_relies_on_the_last_commit(tmp_path, reference):
    env, ckpt = isolated_env(tmp_path / "rt"), tmp_path / "ckpt"
    # 1 s between SIGTERM and the kill, 2 s save margin: an emergency save never fits
    args = ("--save-every", "20", "--step-sleep", "0.01", "--signal-deadline", "1")
    proc = Proc.example(ckpt, STEPS, *args, env=env)
    assert stop_with(proc, signal.SIGTERM, 0.5) == 75, proc.output
    step = int(proc.grab(r"stopped step=(\d+) status=75")[0][1])
    last = committed_step(ckpt)
    assert last is not None and last % 20 == 0 and last <= step
    if step % 20:
        assert last < step and not proc.grab(rf"checkpoint step={step}\b")
    resumed = run_to_end(ckpt, STEPS, *args, env=env)
    assert resumed.grab(rf"start step={last}\b")
    assert final(resumed) == (STEPS, reference)


@pytest.fixture
def fake_daemon(tmp_path):
    daemon = FakeDaemon(tmp_path / "rt").start()
    yield daemon
    daemon.stop()


def launch_registered(tmp_path, daemon: FakeDaemon, *args: str, **env: str) -> Proc:
    proc = Proc.example(tmp_path / "ckpt", STEPS, *args, env=isolated_env(tmp_path / "rt", **env))
    proc.wait_line(r"start step=")
    assert wait_for(lambda: daemon.requests_of("register"))
    return proc


def test_daemon_notice_over_zmq_stops_the_job_and_reports(tmp_path, fake_daemon):
    proc = launch_registered(tmp_path, fake_daemon, "--save-every", "1000", "--step-sleep", "0.01",
                             SPOTGUARD_PROGRESS_SECONDS="0.1")
    # Past its first steps: a notice during the start (restore, first step) exits 75 at once, with
    # nothing trained to save (test_eval_notice.py); under load that window is seconds long.
    assert wait_for(lambda: any(r.step >= 2 for r in fake_daemon.requests_of("progress")), timeout=60), proc.output
    notice = make_notice(20)
    fake_daemon.publish_notice(notice)
    assert proc.finish(30) == 75, proc.output
    stopped = proc.grab(r"stopped step=(\d+) status=75")
    assert stopped, proc.output
    step = int(stopped[0][1])
    assert committed_step(tmp_path / "ckpt") == step
    (register,) = fake_daemon.requests_of("register")
    assert register.pid == proc.popen.pid
    (commit,) = fake_daemon.requests_of("commit")
    assert commit.step == step and commit.path.endswith(f"{step:010d}")
    (safe,) = fake_daemon.requests_of("safe")
    assert safe.notice_ids == [notice.id]


def test_daemon_disappearing_does_not_disturb_training(tmp_path, fake_daemon, reference):
    proc = launch_registered(tmp_path, fake_daemon, "--save-every", "50", "--step-sleep", "0.005")
    fake_daemon.stop()
    assert proc.finish(60) == 0, proc.output
    assert final(proc) == (STEPS, reference)


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotguard_daemon", *args], env=env,
                          capture_output=True, text=True, timeout=30)


def test_real_daemon_drill_stops_the_job_and_its_commit_becomes_durable(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = isolated_env(tmp_path / "rt", SPOTGUARD_STATE_DIR=str(tmp_path / "state"),
                       SPOTGUARD_METRICS__ENABLED="false")
    daemon = subprocess.Popen([sys.executable, "-m", "spotguard_daemon", "daemon", "--platform", "none",
                               "--checkpoint-root", str(ckpt)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: cli("status", env=env).returncode == 0, timeout=20)
        proc = Proc.example(ckpt, STEPS, "--save-every", "1000", "--step-sleep", "0.01", env=env)
        proc.wait_line(r"start step=")
        notice_id = cli("notify", "--kind", "preempt", "--deadline", "30", env=env).stdout.strip()
        assert proc.finish(30) == 75, proc.output
        step = int(proc.grab(r"stopped step=(\d+) status=75")[0][1])
        assert committed_step(ckpt) == step

        def status() -> dict:
            return json.loads(cli("status", "--json", env=env).stdout)

        # the manual notice completes once its clients are safe (the fake-daemon test checks the
        # SafeRequest itself); a relaunch on this node then trains instead of stopping again
        assert wait_for(lambda: notice_id not in [n["id"] for n in status()["notices"]], 10)
        assert wait_for(lambda: [d["step"] for d in status()["uploads"]["durable"].values()] == [step], 20)
    finally:
        daemon.kill()
        daemon.wait(10)
