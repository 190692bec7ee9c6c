"""Two containers of one uid beside one daemon (issue 21 item 6): every DaemonSet pod runs as uid
10001, and every container numbers its processes from 1, so two clients may name the same pid.

Real PID namespaces (``unshare --pid --fork --mount-proc``, as root): the daemon keys a registration by
the process the kernel proves, so both are kept, listed and signalled, and ``spotguard run``'s
registrar registers its own job even when another container's client has the same pid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from spotguard.protocol import NotifyRequest, StatusRequest

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="a PID namespace needs root and unshare")
CONTAINER = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]  # killed with unshare
SIGNAL = {"SPOTGUARD_DELIVERY__SIGNAL": "SIGWINCH"}  # harmless to anything else
CLIENT = """
import json, os, signal, sys, time, zmq
got = []
signal.signal(signal.SIGWINCH, lambda *a: got.append(1))
sock = zmq.Context().socket(zmq.REQ)
sock.connect(sys.argv[1])
sock.send(json.dumps({"type": "register", "pid": int(sys.argv[3] or os.getpid()), "job_id": sys.argv[2]}).encode())
print(os.getpid(), sock.recv().decode(), flush=True)
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print("signalled" if got else "nothing", flush=True)
"""
REGISTRAR = """
import signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "", "", ""], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
from spotguard_daemon.commands.supervise import Registrar
Registrar(sys.argv[1], signal.SIGWINCH).scan(child.pid)
print(child.pid, flush=True)
print(child.stdout.readline().strip(), flush=True)
"""
CATCHER = """
import signal, time
got = []
signal.signal(signal.SIGWINCH, lambda *a: got.append(1))
print("ready", flush=True)
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print("signalled" if got else "nothing", flush=True)
"""


def container(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([*CONTAINER, *argv], stdout=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def clients(daemon) -> list[dict]:
    return daemon.request(StatusRequest()).data["clients"]


def wait_for(what, why, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, why()
        time.sleep(0.05)
    return got


def test_two_containers_pid_1_are_two_clients_and_both_are_signalled(daemon_factory):
    daemon = daemon_factory(env=SIGNAL)
    a = container(sys.executable, "-c", CLIENT, daemon.request_endpoint, "job-a", "")
    b = container(sys.executable, "-c", CLIENT, daemon.request_endpoint, "job-b", "")
    try:
        for proc in (a, b):
            pid, reply = proc.stdout.readline().split(" ", 1)
            assert pid == "1" and json.loads(reply)["ok"] and json.loads(reply)["data"]["signal"], reply
        listed = clients(daemon)
        assert sorted((c["pid"], c["job_id"], c["signal"]) for c in listed) == [(1, "job-a", True),
                                                                               (1, "job-b", True)], listed
        assert daemon.request(NotifyRequest(deadline_seconds=60)).ok
        assert a.stdout.readline().strip() == "signalled" and b.stdout.readline().strip() == "signalled"
        assert "sent SIGWINCH to 2 of 2 processes" in daemon.output()
    finally:
        stop(a)
        stop(b)


def test_the_registrar_registers_its_job_when_another_container_has_a_client_of_that_pid(daemon_factory):
    """Container B's client is its pid 2 and registered first; container A's registrar then finds
    A's job, also pid 2. Before, the registrar took B's entry in ``status`` for its own job and
    never registered it: the notice signalled only B."""
    daemon = daemon_factory(env=SIGNAL)
    b = subprocess.Popen([*CONTAINER, "sh", "-c", f'"{sys.executable}" -c "$0" "$1" job-b "" & wait', CLIENT,
                          daemon.request_endpoint], stdout=subprocess.PIPE, text=True)
    a = None
    try:
        pid, reply = b.stdout.readline().split(" ", 1)
        assert pid == "2" and json.loads(reply)["ok"], reply
        a = container(sys.executable, "-c", REGISTRAR, daemon.request_endpoint, CATCHER)
        assert a.stdout.readline().strip() == "2", "container A's job is not its pid 2: the test proves nothing"
        listed = wait_for(lambda: len(clients(daemon)) == 2 and clients(daemon), daemon.output)
        assert sorted(c["job_id"] for c in listed) == ["", "job-b"] and all(c["pid"] == 2 for c in listed)
        assert daemon.request(NotifyRequest(deadline_seconds=60)).ok
        assert a.stdout.readline().strip() == "signalled", daemon.output()[-2000:]
        assert b.stdout.readline().strip() == "signalled"
    finally:
        for proc in (a, b):
            if proc is not None:
                stop(proc)
