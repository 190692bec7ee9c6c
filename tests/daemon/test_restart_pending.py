"""A daemon SIGKILLed and restarted while each platform's notice is pending: the notice keeps its
deadline, is published again once on PUB to the subscribers that stayed connected, and its signal
reaches the clients, which registered again before it was delivered; the client holds one notice.

The simulator and the daemon run as subprocesses; the client is a real :class:`Guard` in this
process (its pid receives the daemon's SIGUSR1) and a raw SUB socket."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import zmq
from spotguard.guard import Guard
from spotguard.protocol import Kind, NotifyRequest, RegisterRequest, StatusRequest, decode_event

pytestmark = pytest.mark.slow

# platform: (simulator kind, deadline seconds, endpoint suffix)
CASES = {
    "aws": ("terminate", 120, ""),
    "gcp": ("preempt", 30, "/computeMetadata/v1"),
    "azure": ("Preempt", 60, ""),
    "alibaba": ("terminate", 300, ""),
}


def next_notice(sub, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and sub.poll(int(left * 1000)):
        topic, data = sub.recv_multipart()
        if topic == b"notice":
            return decode_event(data).notice
    raise AssertionError(f"no notice within {timeout}s")


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("platform", sorted(CASES))
def test_a_pending_notice_survives_a_sigkill_restart(platform, simulator, daemon_factory):
    sim_kind, seconds, suffix = CASES[platform]
    url = simulator(platform)
    daemon = daemon_factory("--platform", platform, env={
        f"SPOTGUARD_{platform.upper()}__ENDPOINT": url + suffix,
        f"SPOTGUARD_{platform.upper()}__INTERVAL": "0.2", "SPOTGUARD_RUNNER__REQUEST_TIMEOUT": "1",
        "SPOTGUARD_AZURE__ACKNOWLEDGE": "false"})
    ctx = zmq.Context()
    guard = Guard(pub_endpoint=daemon.pub_endpoint, request_endpoint=daemon.request_endpoint,
                  force_exit=False, job_id="restart")
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(daemon.pub_endpoint)
        assert wait_for(lambda: guard.daemon_alive)
        httpx.post(f"{url}/_sim/schedule", json={"kind": sim_kind, "in_seconds": 0.1,
                                                "deadline_seconds": seconds}, timeout=5).raise_for_status()
        before = next_notice(sub)
        assert wait_for(lambda: guard.notice is not None and "sent SIGUSR1 to 1 of 1" in daemon.output())
        # The state file is written right after the delivery: a kill before it is another case (the
        # watcher's first poll announces the notice as new, before the subscribers reconnected).
        assert wait_for(lambda: before.id in (daemon.state_dir / "notices.json").read_text())

        daemon.kill()
        time.sleep(0.5)  # the platform's notice stays pending; nobody watches it meanwhile
        log_start = len(daemon.output())
        daemon.start()
        after = next_notice(sub)  # the same SUB socket, reconnected by ZeroMQ
        assert (after.id, after.deadline) == (before.id, before.deadline)
        # Signalled again, or (the daemon re-announced it before the guard was back) handed the
        # pending notice in the reply to the guard's register: both reach the client.
        assert wait_for(lambda: "sent SIGUSR1 to 1 of 1" in daemon.output()[log_start:]
                        or "registered (rank 0, job 'restart'" in daemon.output()[log_start:]), daemon.output()
        time.sleep(1.0)  # several polls of the restarted watcher: the deadline must not move
        pending = daemon.request(StatusRequest()).data["notices"]
        assert [(n["id"], n["deadline"]) for n in pending] == [(before.id, before.model_dump(mode="json")["deadline"])]
        assert (guard.notice.id, guard.notice.deadline) == (before.id, before.deadline)
        assert len(guard._notices) == 1  # the signals added no local notice
    finally:
        guard.close()
        ctx.destroy(linger=0)


LATE_CLIENT = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: print("SIGUSR1", flush=True))
print("ready", flush=True)
time.sleep(120)
"""


def test_a_client_that_registers_again_only_after_the_re_announcement_still_gets_its_signal(daemon_factory):
    """A loaded node: the restarted daemon re-announces a restored notice before a client registered
    again. The client's late register still brings it the signal it missed, once."""
    daemon = daemon_factory()
    client = subprocess.Popen([sys.executable, "-c", LATE_CLIENT], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline() == "ready\n"
        notice = daemon.request(NotifyRequest(kind=Kind.STOP, deadline_seconds=120)).data["notice"]["id"]
        daemon.kill()
        log_start = len(daemon.output())
        daemon.start()
        assert wait_for(lambda: f"re-announcing notice {notice}" in daemon.output()[log_start:])
        assert wait_for(lambda: "sent SIGUSR1 to 0 of 0 processes" in daemon.output()[log_start:])  # nobody
        # registered again yet (its line follows the re-announcement's, a write later)
        for _ in range(2):  # the second register is not signalled again
            reply = daemon.request(RegisterRequest(pid=client.pid, job_id="late"))
            assert [n["id"] for n in reply.data["notices"]] == [notice]
        assert client.stdout.readline() == "SIGUSR1\n"
        assert wait_for(lambda: "sent SIGUSR1 to 1 of 1 processes that registered again after it went out"
                        in daemon.output())
        time.sleep(0.5)
        assert daemon.output().count("that registered again after it went out") == 1
    finally:
        client.kill()
        client.wait(10)


def test_a_guard_that_saw_no_heartbeat_yet_registers_with_a_daemon_restarted_meanwhile(daemon_factory):
    """The daemon is SIGKILLed before any of its heartbeats reached a guard that registered with it
    (they are a minute apart here) and another one takes its place within the guard's silence
    limit: the new daemon's first heartbeat that arrives still makes the guard register with it."""
    daemon = daemon_factory(env={"SPOTGUARD_ZMQ__HEARTBEAT_INTERVAL": "60"})
    guard = Guard(pub_endpoint=daemon.pub_endpoint, request_endpoint=daemon.request_endpoint,
                  force_exit=False, job_id="restart")
    try:
        assert guard.daemon_alive and "registered (rank 0, job 'restart'" in daemon.output()
        daemon.kill()
        log_start = len(daemon.output())
        daemon.env["SPOTGUARD_ZMQ__HEARTBEAT_INTERVAL"] = "0.2"
        daemon.start()
        assert wait_for(lambda: "registered (rank 0, job 'restart'" in daemon.output()[log_start:],
                        timeout=5), daemon.output()[log_start:]
        assert guard.daemon_alive
    finally:
        guard.close()
