"""Notices that outlive their meaning, an operator's cancel, and a daemon stop that is no preemption
(issue 32, items 1-3 and 14), against real daemons, a real simulator and real clients.

One ``--platform none`` daemon carries the manual-notice checks: a drill whose deadline passed or
whose job ended is withdrawn, ``spotguard notices cancel`` (real CLI) records ``cancelled by
operator``, a client that registered after the notice reads "0 registered when seen, 1 took part",
the register reply names the assumed MTBF, and a SIGTERM with no client raises no NO CLIENT notice.
One ``--platform aws`` daemon on the simulator carries the platform checks: a SIGUSR1 the daemon sent
for a notice the platform cancelled 50 ms later is no stop for the client, an overdue notice is not
offered to a job that starts after its deadline, and a restart with ``--platform none`` drops the
AWS notice it left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import zmq
from spotguard.cadence import DEFAULT_MTBF_SOURCE, DEFAULT_NODE_MTBF_S
from spotguard.protocol import (CommitRequest, Kind, NotifyRequest, RegisterRequest, SafeRequest,
                                StatusRequest, UnregisterRequest)
from test_durable_e2e import commit_dir

from spotguard_daemon.commands.notices import human_timeline
from spotguard_daemon.core.peers import may_operate
from spotguard_daemon.core.server import Peer

pytestmark = pytest.mark.slow


def cli(daemon, *args: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)}
    return subprocess.run([sys.executable, "-m", "spotguard_daemon", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def wait_for(what, seconds: float = 20.0, step: float = 0.05):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(step)
    raise AssertionError(f"not true within {seconds} s: {what}")


def history(daemon) -> dict[str, dict]:
    return {line["id"]: line for line in daemon.request(StatusRequest(history=50)).data["history"]}


def pending(daemon) -> list[str]:
    return [n["id"] for n in daemon.request(StatusRequest()).data["notices"]]


def streak(daemon) -> float:
    text = httpx.get(daemon.request(StatusRequest()).data["metrics"], timeout=5).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("spotguard_notices_without_client_streak ")))


IDLE_CLIENT = """
import json, time, spotguard
guard = spotguard.Guard(job_id="aimed", force_exit=False)
while not guard.daemon_alive:
    time.sleep(0.02)
print(json.dumps(guard.daemon_mtbf), flush=True)
time.sleep(120)
"""


def test_manual_notices_end_with_their_deadline_or_job_and_a_stop_without_clients_is_no_notice(daemon_factory):
    daemon = daemon_factory(env={"SPOTGUARD_DELIVERY__SIGNAL": "none", "SPOTGUARD_STORAGE__BANDWIDTH_MBPS": "1"})
    me = os.getpid()

    # a drill with nobody registered; a job that registers later is told of it, reports safe: the
    # drill is done, and the heading does not claim 0 clients were saved in time
    drill = daemon.request(NotifyRequest(kind=Kind.DRILL, deadline_seconds=60)).data["notice"]["id"]
    reply = daemon.request(RegisterRequest(pid=me, job_id="late"))
    assert [n["id"] for n in reply.data["notices"]] == [drill]
    assert reply.data["mtbf"] == {"node_prior_s": DEFAULT_NODE_MTBF_S, "source": DEFAULT_MTBF_SOURCE}  # item 14
    assert daemon.request(SafeRequest(pid=me, notice_ids=[drill])).ok
    daemon.request(UnregisterRequest(pid=me))
    wait_for(lambda: history(daemon).get(drill, {}).get("outcome") == "saved")
    status = cli(daemon, "status").stdout
    assert "0 registered when seen, 1 took part): saved in time" in status, status
    assert "0 client(s) registered): saved in time" not in status
    assert f"node MTBF of 6 h ({DEFAULT_MTBF_SOURCE})" in status

    # a drill ends at its deadline
    short = daemon.request(NotifyRequest(kind=Kind.DRILL, deadline_seconds=0.5)).data["notice"]["id"]
    wait_for(lambda: history(daemon).get(short, {}).get("cancelled") == "its deadline passed", 10)
    assert short not in pending(daemon)

    # a drill without a deadline ends when the job it was aimed at ends
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)}
    job = subprocess.Popen([sys.executable, "-c", IDLE_CLIENT], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(job.stdout.readline()) == [DEFAULT_NODE_MTBF_S, DEFAULT_MTBF_SOURCE]  # item 14
        aimed = daemon.request(NotifyRequest(kind=Kind.DRILL)).data["notice"]["id"]
        wait_for(lambda: "flagged" in [s["stage"] for s in history(daemon)[aimed]["stages"]])
    finally:
        job.kill()
        job.wait(10)
    wait_for(lambda: history(daemon)[aimed].get("cancelled") == "the job it was aimed at ended", 10)
    assert pending(daemon) == []

    # item 2: the operator withdraws notices through the real CLI
    first, second = (daemon.request(NotifyRequest(kind=Kind.DRILL, deadline_seconds=600)).data["notice"]["id"]
                     for _ in range(2))
    done = cli(daemon, "notices", "cancel", first)
    assert (done.returncode, done.stdout.strip()) == (0, f"cancelled {first}"), done.stderr
    missing = cli(daemon, "notices", "cancel", "manual:drill:nosuch")
    assert missing.returncode == 1 and "no pending notice manual:drill:nosuch" in missing.stderr
    everything = cli(daemon, "notices", "cancel", "--all")
    assert (everything.returncode, everything.stdout.strip()) == (0, f"cancelled {second}")
    lines = history(daemon)
    assert lines[first]["cancelled"] == lines[second]["cancelled"] == "cancelled by operator"
    assert lines[first]["outcome"] == lines[second]["outcome"] == "cancelled"  # not NO CLIENT
    assert "(cancelled by operator)" in human_timeline(lines[second])[0]
    assert pending(daemon) == []
    assert may_operate(Peer(uid=os.geteuid(), pid=me)) and may_operate(Peer(uid=0, pid=me))
    assert not may_operate(Peer(uid=os.geteuid() + 4242, pid=me)) and not may_operate(Peer())

    # item 3: a daemon stopped with no client registered records no notice, and the streak holds;
    # the upload in flight (2 MB at 1 MB/s) still becomes durable before it exits
    before, count = streak(daemon), len(history(daemon))
    ckpt = commit_dir(daemon.checkpoint_root, 7, {"w.bin": os.urandom(2 << 20)})
    assert daemon.request(CommitRequest(pid=me, job_id="job", path=str(ckpt), step=7)).ok
    assert daemon.stop(signal.SIGTERM, timeout=25) == 0
    assert "no client is registered, so no notice is raised (uploads in flight get up to" in daemon.output()
    assert "no client to wait for and every commit durable; stopping" in daemon.output()
    daemon.start()
    assert len(history(daemon)) == count and streak(daemon) == before
    assert daemon.request(StatusRequest()).data["uploads"]["durable"]["job"]["step"] == 7
    assert not any(line.startswith("signal:") for line in history(daemon))


SIGNALLED_CLIENT = """
import json, os, signal, sys, time, spotguard
guard = spotguard.Guard(job_id="withdrawn", force_exit=False)
while not guard.daemon_alive:
    time.sleep(0.02)
os.kill(os.getpid(), signal.SIGUSR1)  # no daemon notice explains this one (Slurm's --signal)
while "local:SIGUSR1:1" not in guard._notices:
    time.sleep(0.02)
# the main thread blocks SIGUSR1 and waits in read(): the daemon's signal is handled only after the
# test's "go", when the notice behind it has been cancelled (a main thread busy in a long C call)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print("ready", flush=True)
sys.stdin.readline()
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
time.sleep(0.5)
print(json.dumps(sorted(guard._notices)), flush=True)
"""


def test_a_cancelled_platform_notice_is_no_stop_an_overdue_one_spares_new_jobs_and_a_restart_drops_it(
        simulator, daemon_factory):
    url = simulator("aws")
    daemon = daemon_factory("--platform", "aws", env={
        "SPOTGUARD_AWS__ENDPOINT": url, "SPOTGUARD_AWS__INTERVAL": "0.05",
        "SPOTGUARD_RUNNER__REQUEST_TIMEOUT": "1"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.pub_endpoint)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)}
    job = subprocess.Popen([sys.executable, "-c", SIGNALLED_CLIENT], env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)

    def next_topic(wanted: bytes) -> bytes:
        while sub.poll(15000):
            topic, data = sub.recv_multipart()
            if topic == wanted:
                return data
        raise AssertionError(f"no {wanted!r} event: {daemon.output()}")

    try:
        assert job.stdout.readline().strip() == "ready"
        httpx.post(f"{url}/_sim/schedule", json={"kind": "terminate", "in_seconds": 0.05,
                                                "deadline_seconds": 120}, timeout=5).raise_for_status()
        next_topic(b"notice")
        httpx.post(f"{url}/_sim/cancel", json={}, timeout=5).raise_for_status()  # about 50 ms later
        next_topic(b"cancel")
        assert "sent SIGUSR1 to 1 of 1" in daemon.output()
        time.sleep(0.3)  # the client's guard thread takes the cancel event
        job.stdin.write("go\n")
        job.stdin.flush()
        held = json.loads(job.stdout.readline())
    finally:
        job.kill()
        job.wait(10)
    assert held == ["local:SIGUSR1:1"]  # the daemon's signal added no local notice after the cancel

    # a platform notice past its deadline on a node still alive: overdue, not offered to a new job
    httpx.post(f"{url}/_sim/schedule", json={"kind": "terminate", "in_seconds": 0.05,
                                            "deadline_seconds": 1}, timeout=5).raise_for_status()
    overdue = json.loads(next_topic(b"notice"))["notice"]["id"]
    wait_for(lambda: daemon.request(StatusRequest()).data["overdue"], 10)
    reply = daemon.request(RegisterRequest(pid=os.getpid(), job_id="after"))
    daemon.request(UnregisterRequest(pid=os.getpid()))
    assert reply.data["notices"] == [] and pending(daemon) == []
    shown = cli(daemon, "status").stdout
    assert overdue in shown and "OVERDUE: deadline passed" in shown, shown
    wait_for(lambda: daemon.output().count(f"notice {overdue} passed its deadline") == 1, 5)

    # restarted without the AWS watcher: the AWS notice it left pending is dropped, not re-announced
    daemon.kill()
    daemon.args = daemon.args[:-2] + ["--platform", "none"]
    daemon.start()
    data = daemon.request(StatusRequest()).data
    assert data["notices"] == data["overdue"] == []
    assert f"dropping notice {overdue} left pending by the previous run" in daemon.output()
    assert "re-announcing" not in daemon.output()
    sub.close(linger=0)
