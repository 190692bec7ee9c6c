"""Interruption counts stay bounded, and a real daemon keeps answering and pinging systemd's watchdog,
whatever the three ways in bring: a ``progress.json`` planted in the store (``file://``), a
``goodput.json`` state file with out-of-bounds figures, and one process re-registering with rising
``resumed_from_step`` or naming another process's job (a register claim alone is no evidence of an
interruption). One daemon plays all of them."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from datetime import datetime, timezone

import pytest
from spotguard.protocol import CadenceRequest, ProgressRequest, RegisterRequest, StatusRequest
from spotguard_daemon.core.goodput import MAX_INTERRUPTIONS

from _runs import Runs
from test_goodput_fresh_node import wait_for


def stored(job: str, now: float, interruptions: int) -> dict:
    return {"version": 2, "job": job, "step": 5, "at": now - 60, "reached": [[5, now - 120]],
            "written": now - 30, "interruptions": interruptions, "running": 10.0, "nodes": 1}


def state_item(job: str, now: float, interruptions) -> dict:
    return {"job": job, "step": 1, "at": now, "reached": [], "pid": 0, "interruptions": interruptions,
            "running": 5.0, "nodes": 1, "drilled": False}


def pings(listener: socket.socket, seconds: float) -> int:
    """WATCHDOG=1 datagrams received over the next ``seconds`` (older ones dropped first)."""
    listener.setblocking(False)
    try:
        while True:
            listener.recv(256)
    except BlockingIOError:
        pass
    listener.settimeout(0.05)
    count, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            count += listener.recv(256) == b"WATCHDOG=1"
        except TimeoutError:
            pass
    return count


@pytest.fixture
def notify(sock_dir):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(sock_dir / "notify.sock"))
    yield listener
    listener.close()


@pytest.mark.timeout(120)
def test_planted_and_claimed_interruptions_stay_bounded_and_the_watchdog_keeps_pinging(
        daemon_factory, tmp_path, sock_dir, notify):
    now, bucket = time.time(), tmp_path / "bucket"
    for job, count in (("planted", 2**53), ("capped", MAX_INTERRUPTIONS)):
        (bucket / "jobs" / job).mkdir(parents=True)
        (bucket / "jobs" / job / "progress.json").write_text(json.dumps(stored(job, now, count)))
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}",
                                 "NOTIFY_SOCKET": str(sock_dir / "notify.sock"), "WATCHDOG_USEC": "200000"},
                            start=False)
    daemon.state_dir.mkdir(parents=True)
    (daemon.state_dir / "goodput.json").write_text(json.dumps({"version": 1, "jobs": [
        state_item("state-huge", now, 2**53), state_item("state-bool", now, True),
        state_item("state-fine", now, 3)]}))
    daemon.start()
    runs, victim = Runs(), subprocess.Popen(["sleep", "120"])

    def rate(job: str) -> dict | None:
        return daemon.request(CadenceRequest(job_id=job)).data["rate"]

    def progress(pid: int, job: str, step: int) -> None:
        assert daemon.request(ProgressRequest(pid=pid, job_id=job, step=step, at=datetime.now(timezone.utc))).ok

    try:
        # the store: one object out of bounds (ignored), one at the bound (adopted, clamped)
        assert daemon.request(RegisterRequest(pid=runs.next(), job_id="planted", resumed_from_step=5)).ok
        assert daemon.request(RegisterRequest(pid=runs.next(), job_id="capped", resumed_from_step=5)).ok
        # the wire: one process re-registering with rising steps counts one restart at most
        pid = runs.next()
        assert daemon.request(RegisterRequest(pid=pid, job_id="rise")).ok
        progress(pid, "rise", 1)
        for step in range(1, 40):
            assert daemon.request(RegisterRequest(pid=pid, job_id="rise", resumed_from_step=step)).ok
        # and 50 registers naming a job whose rank 0 still runs count nothing
        assert daemon.request(RegisterRequest(pid=victim.pid, job_id="victim")).ok
        progress(victim.pid, "victim", 3)
        attacker = runs.next()
        for _ in range(50):
            assert daemon.request(RegisterRequest(pid=attacker, job_id="victim", resumed_from_step=1)).ok
        wait_for(lambda: (rate("capped") or {}).get("interruptions") == MAX_INTERRUPTIONS,
                 "the capped store object adopted", 10)
        assert rate("planted")["interruptions"] == 0  # its object was refused: counts from here on
        assert rate("rise")["interruptions"] <= 1 and rate("victim")["interruptions"] == 0
        assert rate("state-huge") is None and rate("state-bool") is None  # the state file's bad jobs
        assert rate("state-fine")["interruptions"] == 3
        assert pings(notify, 1.5) >= 3
        assert daemon.request(StatusRequest()).ok
    finally:
        runs.end()
        victim.kill()
        victim.wait()
    assert "housekeeping" not in daemon.output() and "Traceback" not in daemon.output()


def test_a_failing_housekeeping_step_stops_neither_the_others_nor_the_watchdog(sock_dir, tmp_path, notify,
                                                                               monkeypatch, caplog):
    """The daemon's housekeeping with one step that always raises (the job rates' snapshot, as a
    count past 2**53 once made it): the pings go on, so do the other steps, the failure is logged
    once and counted every pass."""
    import asyncio

    from test_daemon_e2e import in_process_daemon

    monkeypatch.setenv("NOTIFY_SOCKET", str(sock_dir / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    daemon = in_process_daemon(sock_dir, tmp_path)
    flushed = []

    def broken() -> None:
        raise ValueError("interruptions must be an integer >= 0")

    daemon.rates.snapshot = broken
    daemon.handler.ledger.flush = lambda: flushed.append(1)

    async def run_a_while() -> None:
        task = asyncio.ensure_future(daemon._housekeeping())
        await asyncio.sleep(1.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level("ERROR"):
        asyncio.run(run_a_while())
    notify.setblocking(False)
    queued = []
    while True:
        try:
            queued.append(notify.recv(256))
        except BlockingIOError:
            break
    assert len(flushed) >= 5 and queued.count(b"WATCHDOG=1") >= 5  # every 0.05 s for 1 s
    assert daemon.metrics.task_restarts.labels(task="housekeeping: job rates")._value.get() >= 5
    assert sum("housekeeping: job rates failed" in r.getMessage() for r in caplog.records) >= 5
    assert sum(r.exc_info is not None for r in caplog.records) == 1  # the traceback once per cause
