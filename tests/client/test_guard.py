"""Guard: signals become local notices, daemon notices arrive over real ZeroMQ, reconnects work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from spotguard import _record
from spotguard.guard import Guard
from spotguard.protocol import Kind

from _fake_daemon import FakeDaemon, make_notice, wait_for


@pytest.fixture
def daemon(tmp_path):
    fake = FakeDaemon(tmp_path / "rt").start()
    yield fake
    fake.stop()


def guard_for(daemon: FakeDaemon, **kwargs) -> Guard:
    kwargs.setdefault("force_exit", False)  # never os._exit the test runner
    return Guard(pub_endpoint=daemon.pub_endpoint, request_endpoint=daemon.request_endpoint,
                 job_id="job-1", rank=3, **kwargs)


def test_sigterm_without_daemon_becomes_a_local_notice_with_the_default_deadline():
    with Guard(daemon=False, force_exit=False) as guard:
        assert guard.notice is None and not guard.stop_requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(lambda: guard.stop_requested)
        notice = guard.notice
        assert notice.kind is Kind.SIGNAL and notice.platform == "local"
        assert 28 < guard.seconds_left() <= 30


def test_sigusr1_without_a_configured_deadline_has_none():
    with Guard(daemon=False, force_exit=False, signal_deadlines={signal.SIGUSR1: None}) as guard:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: guard.stop_requested)
        assert guard.seconds_left() is None


def test_previous_handlers_are_restored_on_close():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *a: seen.append(a))
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or what an earlier test left in this worker
    try:
        guard = Guard(daemon=False, force_exit=False)
        assert signal.getsignal(signal.SIGUSR1).__self__ is guard
        guard.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: seen)
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_daemon_notice_over_zmq_sets_stop_and_registers(daemon):
    with guard_for(daemon) as guard:
        assert wait_for(lambda: guard.daemon_alive)
        (register,) = daemon.requests_of("register")
        assert (register.pid, register.rank, register.job_id) == (os.getpid(), 3, "job-1")
        notice = make_notice(20)
        daemon.publish_notice(notice)
        assert wait_for(lambda: guard.stop_requested)
        assert guard.notice.id == notice.id
        assert 18 < guard.seconds_left() <= 20


def test_late_client_learns_a_pending_notice_from_status(daemon):
    notice = make_notice(40)
    daemon.publish_notice(notice)  # nobody listens yet: lost to PUB/SUB
    with guard_for(daemon) as guard:
        assert guard.stop_requested and guard.notice.id == notice.id


def test_cancel_clears_a_notice_before_the_stop_began_but_not_after(daemon):
    with guard_for(daemon) as guard:
        first, second = make_notice(30), make_notice(30)
        daemon.publish_notice(first)
        assert wait_for(lambda: guard.stop_requested)
        daemon.publish_cancel(first.id)
        assert wait_for(lambda: not guard.stop_requested)
        daemon.publish_notice(second)
        assert wait_for(lambda: guard.stop_requested)
        guard.begin_stop()
        daemon.publish_cancel(second.id)
        time.sleep(0.3)
        assert guard.stop_requested


def test_advisory_notice_requests_a_checkpoint_not_a_stop(daemon):
    with guard_for(daemon) as guard:
        daemon.publish_notice(make_notice(600, terminating=False, kind="rebalance"))
        assert wait_for(lambda: guard.checkpoint_requested)
        assert not guard.stop_requested
        guard.clear_checkpoint_request()
        assert not guard.checkpoint_requested
    with guard_for(daemon, stop_on_advisory=True) as guard:
        assert guard.stop_requested  # learnt from status, and advisory stops count now


def test_reports_reach_the_daemon(daemon):
    class Info:
        step, path, size_bytes, files = 7, "/ckpt/step-7", 1234, ["a", "b"]

    with guard_for(daemon) as guard:
        notice = make_notice(30)
        daemon.publish_notice(notice)
        assert wait_for(lambda: guard.stop_requested)
        assert guard.report_commit(Info())
        assert guard.report_safe()
    (commit,) = daemon.requests_of("commit")
    assert (commit.step, commit.path, commit.size_bytes, commit.files, commit.job_id) == \
        (7, "/ckpt/step-7", 1234, 2, "job-1")
    (safe,) = daemon.requests_of("safe")
    assert safe.notice_ids == [notice.id] and safe.pid == os.getpid()
    assert daemon.requests_of("unregister")


def test_a_resume_report_names_the_tier_its_checkpoint_came_from(daemon):
    with guard_for(daemon) as guard:
        assert guard.report_resume(8, "peer")
        assert guard.report_resume(9)  # a caller that cannot tell
    resumes = [r for r in daemon.requests_of("register") if r.resumed_from_step is not None]
    assert [(r.resumed_from_step, r.resumed_tier, r.rank, r.job_id) for r in resumes] == \
        [(8, "peer", 3, "job-1"), (9, None, 3, "job-1")]


def test_daemon_gone_then_restarted_is_rejoined(daemon):
    with guard_for(daemon) as guard:
        assert wait_for(lambda: guard.daemon_alive)
        time.sleep(0.3)  # heartbeats arrive: the silence limit becomes a few 0.1 s intervals
        daemon.stop()
        assert wait_for(lambda: not guard.daemon_alive, timeout=3)
        started = time.monotonic()
        assert not guard.report_safe()  # training goes on: no wait when the daemon is gone
        assert time.monotonic() - started < 0.4  # less than the 0.5 s request timeout: nothing was sent
        notice = make_notice(30)
        daemon.pending.append(notice)  # published while nobody listened
        daemon.restart()
        assert wait_for(lambda: guard.daemon_alive and guard.stop_requested, timeout=5)
        assert guard.notice.id == notice.id
        assert len(daemon.requests_of("register")) == 2  # registered again with the new daemon


def test_no_daemon_at_all_does_not_slow_or_crash(tmp_path):
    started = time.monotonic()
    with Guard(pub_endpoint=f"ipc://{tmp_path}/none.sock", request_endpoint=f"ipc://{tmp_path}/no.sock",
               force_exit=False, request_timeout=0.2) as guard:
        assert not guard.daemon_alive and not guard.stop_requested
        assert not guard.report_commit(type("I", (), {"step": 1, "path": "p", "size_bytes": 0,
                                                       "files": 0})())
    assert time.monotonic() - started < 2


FORCED = textwrap.dedent("""
    import os, signal, sys, time
    from spotguard.guard import Guard
    guard = Guard(daemon=False, signal_deadlines={signal.SIGTERM: 2.5, signal.SIGUSR1: None},
                  force_exit_margin=1.0, force_exit_timeout=1.5)
    print("signalled at", time.monotonic(), flush=True)
    os.kill(os.getpid(), signal.SIGUSR1 if sys.argv[1] == "usr1" else signal.SIGTERM)
    print("hanging", flush=True)
    time.sleep(30)   # a hung collective
    print("not reached", flush=True)
""")


@pytest.mark.parametrize("sig, low, high", [("term", 1.0, 2.4), ("usr1", 1.3, 3.0)])
def test_forced_exit_fires_before_the_deadline_when_the_stop_hangs(tmp_path, sig, low, high):
    script = tmp_path / "hang.py"
    script.write_text(FORCED)
    record = tmp_path / "record.jsonl"
    proc = subprocess.run([sys.executable, str(script), sig], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPOTGUARD_RECORD": str(record)})
    ended = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    assert proc.returncode == 76, proc.stderr
    assert "hanging" in proc.stdout and "not reached" not in proc.stdout
    assert "forced exit 76" in proc.stderr
    signalled = float(proc.stdout.split("signalled at ")[1].split()[0])
    assert low < ended - signalled < high + 1.0  # timed from the signal: start-up under load is not in it
    # written just before the exit, so `spotguard run` tells torchrun's status 1 after it from a crash
    assert [e["event"] for e in _record.read(record)] == ["forced_exit"]


def test_watchdog_is_armed_by_a_stopping_notice_and_disarmed_by_its_cancel(daemon):
    with guard_for(daemon, force_exit=True, force_exit_margin=2.0) as guard:
        watchdog = guard._watchdog
        advisory, stop = make_notice(600, terminating=False), make_notice(30)
        daemon.publish_notice(advisory)
        assert wait_for(lambda: guard.checkpoint_requested)
        assert watchdog.armed_at is None  # advisory notices never force an exit
        daemon.publish_notice(stop)
        assert wait_for(lambda: watchdog.armed_at is not None)
        assert 26 < watchdog.armed_at - time.monotonic() <= 28  # deadline minus the margin
        daemon.publish_cancel(stop.id)
        assert wait_for(lambda: watchdog.armed_at is None)


def test_a_rescheduled_notice_updates_the_deadline_the_guard_holds(daemon):
    with guard_for(daemon) as guard:
        daemon.publish_notice(make_notice(300, notice_id="evt"))
        assert wait_for(lambda: guard.stop_requested)
        assert 290 < guard.seconds_left() <= 300
        daemon.publish_notice(make_notice(40, notice_id="evt"))  # the daemon re-announces it earlier
        assert wait_for(lambda: guard.seconds_left() < 50)
        assert guard.notice.id == "evt"


def test_a_register_without_a_tier_is_what_an_older_daemon_takes():
    """``resumed_tier`` came after daemons that refuse fields they do not know: left out while None,
    a register from this client still parses against the message as such a daemon knew it."""
    from pydantic import ConfigDict, create_model
    from spotguard.protocol import RegisterRequest, encode

    fields = {name: (info.annotation, info) for name, info in RegisterRequest.model_fields.items()
              if name != "resumed_tier"}
    older = create_model("OlderRegister", __config__=ConfigDict(extra="forbid"), **fields)
    assert "resumed_tier" not in json.loads(encode(RegisterRequest(pid=5, resumed_from_step=3)))
    older.model_validate_json(encode(RegisterRequest(pid=5, resumed_from_step=3)))
    assert json.loads(encode(RegisterRequest(pid=5, resumed_from_step=3, resumed_tier="peer")))["resumed_tier"] == "peer"
