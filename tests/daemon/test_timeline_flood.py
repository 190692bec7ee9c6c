"""A flood of register and ``safe`` requests leaves the notice timeline bounded: over ``tcp://``
(unproven peers) it writes nothing to the timeline; over ``ipc://`` (one proven process naming a
new job each time) the timeline waits for at most ``MAX_JOBS`` jobs and counts the rest. ``status``
stays far under the 1 MiB reply limit, and ``spotguard notices`` prints no control character that
came from a client."""

from __future__ import annotations

import os
import signal
import socket

import pytest
import zmq
from spotguard.protocol import (Kind, NotifyRequest, RegisterRequest, SafeRequest, StatusRequest, decode_reply,
                                encode)
from spotguard_daemon.core.timeline import MAX_JOBS

from _runs import Runs
from test_notice_timeline import cli

EVIL = "\x1b]0;owned\x07\x1b[2J"
FLOOD = 300


def flood(endpoint: str, pid: int, notice: str) -> None:
    """``FLOOD`` register + committed safe pairs, each naming a new job, over one socket."""
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        for i in range(FLOOD):
            for message in (RegisterRequest(pid=pid, job_id=f"job-{i}{EVIL}"),
                            SafeRequest(pid=pid, notice_ids=[notice], save="committed", step=1)):
                sock.send(encode(message))
                assert sock.poll(5000), "the daemon stopped answering"
                assert decode_reply(sock.recv()).ok


def status_size(daemon) -> int:
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.request_endpoint)
        sock.send(encode(StatusRequest()))
        assert sock.poll(5000)
        return len(sock.recv())


@pytest.fixture
def ignore_usr1():
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the notice's delivery signal
    yield
    signal.signal(signal.SIGUSR1, previous)


def test_unproven_peers_write_nothing_to_the_timeline(daemon_factory):
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    daemon = daemon_factory(env={"SPOTGUARD_ZMQ__REQUEST_ENDPOINT": f"tcp://127.0.0.1:{ports[0]}",
                                 "SPOTGUARD_ZMQ__PUB_ENDPOINT": f"tcp://127.0.0.1:{ports[1]}"})
    notice = daemon.request(NotifyRequest(kind=Kind.PREEMPT, deadline_seconds=60)).data["notice"]["id"]
    flood(daemon.request_endpoint, 4242, notice)
    line = daemon.request(StatusRequest()).data["timeline"]
    assert line["id"] == notice and line["waiting_for_durable"] == []
    assert not any("pid" in stage for stage in line["stages"])
    assert status_size(daemon) < 64 * 1024


def test_a_proven_flood_keeps_the_jobs_bounded_and_the_output_clean(daemon_factory, ignore_usr1):
    daemon = daemon_factory()
    runs = Runs()  # a client that never reports safe keeps the notice pending through the flood
    try:
        assert daemon.request(RegisterRequest(pid=runs.next(), job_id="slow")).ok
        notice = daemon.request(NotifyRequest(kind=Kind.PREEMPT, deadline_seconds=60)).data["notice"]["id"]
        flood(daemon.request_endpoint, os.getpid(), notice)
    finally:
        runs.end()
    line = daemon.request(StatusRequest()).data["timeline"]
    assert len(line["waiting_for_durable"]) == MAX_JOBS and line["jobs_left_out"] == FLOOD - MAX_JOBS
    assert status_size(daemon) < 256 * 1024
    shown = cli(daemon, "notices")
    assert shown.returncode == 0 and "job-0\\x1b]0;owned\\x07" in shown.stdout
    assert not any(ch in shown.stdout for ch in "\x1b\x07")
    status = cli(daemon, "status")
    assert status.returncode == 0 and "\x1b" not in status.stdout
