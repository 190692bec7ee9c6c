"""The daemon as a real subprocess (``--platform none``) with real ZeroMQ clients and real signals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import zmq
from spotguard.protocol import (
    CommitRequest, Kind, NotifyRequest, RegisterRequest, SafeRequest, StatusRequest,
    UnregisterRequest, decode_event,
)

from _recorder import start_recorder

pytestmark = pytest.mark.slow



@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def child(tmp_path):
    """A real process that records SIGUSR1 into a file; it registers with the daemon by pid."""
    out = tmp_path / "child-got"
    proc = start_recorder(out)
    yield proc, out
    proc.kill()
    proc.wait()


def subscribe(ctx, daemon):
    """A SUB socket that has seen a heartbeat, so the next published event reaches it."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.pub_endpoint)
    next_event(sub, "heartbeat")
    return sub


def next_event(sub, topic: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if sub.poll(int(left * 1000)):
            got_topic, data = sub.recv_multipart()
            if got_topic == topic.encode():
                return decode_event(data)
    raise AssertionError(f"no {topic} event within {timeout}s")


def notify(daemon, seconds: float = 300, kind: Kind = Kind.DRILL) -> str:
    reply = daemon.request(NotifyRequest(kind=kind, deadline_seconds=seconds, detail="e2e"))
    assert reply.ok, reply
    return reply.data["notice"]["id"]


def test_manual_notice_reaches_a_subscriber(daemon_factory, zctx):
    daemon = daemon_factory()
    sub = subscribe(zctx, daemon)
    notice_id = notify(daemon, 120, Kind.PREEMPT)
    event = next_event(sub, "notice")
    assert event.notice.id == notice_id and event.notice.kind is Kind.PREEMPT
    assert 110 < event.notice.seconds_left() <= 120


def test_late_subscriber_learns_the_pending_notice(daemon_factory, zctx):
    daemon = daemon_factory()
    notice_id = notify(daemon)
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.pub_endpoint)
    assert notice_id in next_event(sub, "heartbeat").pending
    assert [n["id"] for n in daemon.request(StatusRequest()).data["notices"]] == [notice_id]


def test_restart_re_announces_pending_notices_but_not_its_own_signal(daemon_factory, zctx):
    first = daemon_factory()
    notice_id = notify(first)
    assert first.stop() == 0
    second = daemon_factory()
    pending = [n["id"] for n in second.request(StatusRequest()).data["notices"]]
    assert pending == [notice_id]  # pending at once; published once the clients had time to return
    for _ in range(250):
        if "re-announcing notice" in second.output():
            break
        time.sleep(0.02)
    assert "re-announcing notice" in second.output()


def test_terminating_notice_signals_a_registered_process(daemon_factory, child):
    proc, out = child
    daemon = daemon_factory()
    assert daemon.request(RegisterRequest(pid=proc.pid, rank=0, job_id="j")).ok
    notify(daemon, 60, Kind.TERMINATE)
    for _ in range(250):
        if out.exists():
            break
        time.sleep(0.02)
    assert out.read_text() == "usr1"


def test_sigterm_publishes_a_signal_notice_and_exits_after_the_client_is_safe(daemon_factory, child, zctx):
    proc, _out = child
    daemon = daemon_factory(env={"SPOTGUARD_SIGNAL__GRACE": "30"})
    assert daemon.request(RegisterRequest(pid=proc.pid)).ok
    sub = subscribe(zctx, daemon)
    daemon.proc.send_signal(signal.SIGTERM)
    event = next_event(sub, "notice")
    assert event.notice.kind is Kind.SIGNAL and 25 < event.notice.seconds_left() <= 30
    time.sleep(0.5)
    assert daemon.proc.poll() is None, "must keep serving until the client is safe"
    status = daemon.request(StatusRequest()).data
    assert status["draining"] and [c["pid"] for c in status["clients"]] == [proc.pid]
    started = time.monotonic()
    assert daemon.request(SafeRequest(pid=proc.pid, notice_ids=[event.notice.id])).ok
    assert daemon.proc.wait(10) == 0 and time.monotonic() - started < 5


def test_sigterm_exits_after_the_grace_when_no_client_reports_safe(daemon_factory, child):
    proc, _out = child
    daemon = daemon_factory(env={"SPOTGUARD_SIGNAL__GRACE": "1.5"})
    assert daemon.request(RegisterRequest(pid=proc.pid)).ok
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(15) == 0
    assert 1.2 < time.monotonic() - started < 8
    assert "grace of 1.5s passed" in daemon.output()


def test_second_sigterm_exits_at_once_and_unregister_releases(daemon_factory, child):
    proc, _out = child
    daemon = daemon_factory(env={"SPOTGUARD_SIGNAL__GRACE": "60"})
    assert daemon.request(RegisterRequest(pid=proc.pid)).ok
    daemon.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert daemon.proc.poll() is None
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(10) == 0 and time.monotonic() - started < 5

    again = daemon_factory(env={"SPOTGUARD_SIGNAL__GRACE": "60"})
    assert again.request(RegisterRequest(pid=proc.pid)).ok
    again.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert again.request(UnregisterRequest(pid=proc.pid)).data == {"known": True}
    assert again.proc.wait(10) == 0


def test_a_registered_client_that_died_is_dropped(daemon_factory, child):
    proc, _out = child
    daemon = daemon_factory(env={"SPOTGUARD_SIGNAL__GRACE": "60"})
    assert daemon.request(RegisterRequest(pid=proc.pid)).ok
    proc.kill()
    proc.wait()
    assert daemon.request(StatusRequest()).data["clients"] == []
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(10) == 0


def test_commit_paths_are_confined_to_the_checkpoint_root(daemon_factory, tmp_path):
    daemon = daemon_factory()
    root = daemon.checkpoint_root
    (root / "job" / "step-0000000010").mkdir(parents=True)
    (root / "job" / "step-0000000010" / "manifest.json").write_text('{"step": 10}')
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape").symlink_to(outside)

    def commit(path: str):
        return daemon.request(CommitRequest(pid=os.getpid(), path=path, step=10))

    ok = commit(str(root / "job" / "step-0000000010"))
    assert ok.ok and ok.data["path"] == str((root / "job" / "step-0000000010").resolve())
    assert commit("job/step-0000000010").ok  # relative to the root
    for bad in (str(root / ".." / "outside"), "../outside", str(root / "escape"), str(outside), "/etc"):
        reply = commit(bad)
        assert not reply.ok and "outside the checkpoint root" in reply.error, (bad, reply)
    missing = commit(str(root / "job" / "nope"))
    assert not missing.ok and "does not exist" in missing.error


def test_systemd_readiness_watchdog_and_stopping(daemon_factory, sock_dir):
    address = str(sock_dir / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(address)
    listener.settimeout(10)
    try:
        daemon = daemon_factory(env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"})
        states = [listener.recv(256).decode() for _ in range(3)]
        assert states[0] == "READY=1" and "WATCHDOG=1" in states[1:]
        daemon.stop()
        rest = []
        while "STOPPING=1" not in rest:
            rest.append(listener.recv(256).decode())
    finally:
        listener.close()


def test_tcp_loopback_endpoints_for_sidecars(daemon_factory, zctx):
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    pub, req = (f"tcp://127.0.0.1:{port}" for port in ports)
    daemon = daemon_factory(env={"SPOTGUARD_ZMQ__PUB_ENDPOINT": pub, "SPOTGUARD_ZMQ__REQUEST_ENDPOINT": req})
    assert daemon.request(StatusRequest()).data["pub_endpoint"] == pub
    sub = subscribe(zctx, daemon)
    notice_id = notify(daemon, 30)
    assert next_event(sub, "notice").notice.id == notice_id
    assert not (daemon.runtime_dir / "requests.sock").exists()


def in_process_daemon(sock_dir, tmp_path, **settings):
    from spotguard_daemon.core.app import Daemon
    from spotguard_daemon.core.settings import load_settings

    (tmp_path / "ckpt").mkdir(exist_ok=True)
    return Daemon(load_settings(None, platform="none", runtime_dir=sock_dir / "run",
                                state_dir=tmp_path / "state", checkpoint_root=tmp_path / "ckpt",
                                metrics={"enabled": False}, **settings), watchers=[])


def test_accepted_commits_reach_the_on_commit_hook(sock_dir, tmp_path, ask):
    import asyncio

    daemon = in_process_daemon(sock_dir, tmp_path)
    (tmp_path / "ckpt" / "step-0000000005").mkdir()
    (tmp_path / "ckpt" / "step-0000000005" / "manifest.json").write_text('{"step": 5}')
    seen = []
    daemon.on_commit = lambda request, path: seen.append((request.step, path))

    async def main():
        task = asyncio.create_task(daemon.run())
        endpoint = f"ipc://{sock_dir}/run/requests.sock"
        ok = await asyncio.to_thread(ask, endpoint, CommitRequest(pid=os.getpid(), path="step-0000000005", step=5))
        bad = await asyncio.to_thread(ask, endpoint, CommitRequest(pid=os.getpid(), path="../x", step=6))
        daemon.stop()
        return ok, bad, await asyncio.wait_for(task, 10)

    ok, bad, status = asyncio.run(main())
    assert ok.ok and not bad.ok and status == 0
    assert seen == [(5, (tmp_path / "ckpt" / "step-0000000005").resolve())]


def test_a_core_loop_that_dies_is_restarted_and_counted_and_the_daemon_stays_up(sock_dir, tmp_path):
    """No loop's failure stops the daemon (one request could otherwise keep it down): the loop is
    started again after a backoff and the failure counted."""
    import asyncio

    daemon = in_process_daemon(sock_dir, tmp_path)
    calls: list[float] = []

    async def flaky_heartbeats():
        calls.append(asyncio.get_running_loop().time())
        if len(calls) <= 2:
            raise RuntimeError("boom")
        daemon.stop()
        await asyncio.Event().wait()  # a loop runs until cancelled

    daemon.server.heartbeats = flaky_heartbeats
    assert asyncio.run(asyncio.wait_for(daemon.run(), 30)) == 0
    assert len(calls) == 3 and calls[2] - calls[1] >= 2 * (calls[1] - calls[0]) * 0.9  # backing off
    assert daemon.metrics.task_restarts.labels(task="heartbeats")._value.get() == 2


GUARDED = """
import sys, time
from spotguard.guard import Guard
guard = Guard(job_id="e2e", force_exit=False)
while not guard.daemon_alive:
    time.sleep(0.05)
print("ready", flush=True)
while guard.notice is None or guard.notice.platform == "local":
    time.sleep(0.05)
print(guard.notice.id, guard.stop_requested, guard.report_safe(), flush=True)
guard.close()
"""


def test_the_client_library_against_the_real_daemon(daemon_factory):
    daemon = daemon_factory(env={"SPOTGUARD_DELIVERY__SIGNAL": "none"})  # the notice alone must do
    env = {**os.environ, "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)}
    proc = subprocess.Popen([sys.executable, "-c", GUARDED], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        notice_id = notify(daemon, 60, Kind.PREEMPT)
        assert proc.stdout.readline().split() == [notice_id, "True", "True"]
        # The client reported safe: that completes a manual notice, so the daemon withdraws it.
        for _ in range(100):
            if notice_id not in daemon.request(StatusRequest()).data["safe"]:
                break
            time.sleep(0.05)
        assert notice_id not in daemon.request(StatusRequest()).data["safe"]
        assert "every registered client reported safe" in daemon.output()
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_drill_completes_once_every_client_is_safe_so_a_relaunch_trains(daemon_factory, child, zctx):
    proc, _out = child
    daemon = daemon_factory()
    assert daemon.request(RegisterRequest(pid=proc.pid)).ok
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert daemon.request(RegisterRequest(pid=other.pid, rank=1)).ok
        sub = subscribe(zctx, daemon)
        drill = notify(daemon, 60, Kind.DRILL)
        assert daemon.request(SafeRequest(pid=proc.pid, notice_ids=[drill])).ok
        time.sleep(0.3)
        assert [n["id"] for n in daemon.request(StatusRequest()).data["notices"]] == [drill]
        assert daemon.request(SafeRequest(pid=other.pid, notice_ids=[drill])).ok
        cancel = next_event(sub, "cancel")
        assert cancel.id == drill and "safe" in cancel.reason
        assert daemon.request(StatusRequest()).data["notices"] == []
    finally:
        other.kill()
        other.wait()


def test_a_safe_report_after_the_process_was_reaped_still_completes_the_drill(daemon_factory, zctx):
    """``spotguard run`` reports its plain job safe once it exited 75, and the daemon's reaper may
    have unregistered the dead process first: the drill must still be withdrawn (CI saw it stay)."""
    daemon = daemon_factory(env={"SPOTGUARD_DELIVERY__SIGNAL": "none"})
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert daemon.request(RegisterRequest(pid=job.pid)).ok
        sub = subscribe(zctx, daemon)
        drill = notify(daemon, 60, Kind.DRILL)
    finally:
        job.kill()
        job.wait()
    deadline = time.monotonic() + 10
    while daemon.request(StatusRequest()).data["clients"]:
        assert time.monotonic() < deadline, "the daemon never reaped the dead client"
        time.sleep(0.05)
    assert [n["id"] for n in daemon.request(StatusRequest()).data["notices"]] == [drill]  # death is not safety
    assert daemon.request(SafeRequest(pid=job.pid, notice_ids=[drill])).ok
    cancel = next_event(sub, "cancel")
    assert cancel.id == drill and "safe" in cancel.reason
    assert daemon.request(StatusRequest()).data["notices"] == []
