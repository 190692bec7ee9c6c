"""``spotguard run`` as a container's entry point: PID 1 of its own PID namespace (``unshare``),
beside a daemon outside it, as with a daemon on the host or in a sidecar.

It reaps the orphans reparented to it, and it registers the job by its pid in the container: the
daemon finds the process below the sender and signals it. A client in the container that names any
other pid (here one of the host, which the pid would name on the host) is refused, root or not,
and that process is never signalled.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spotguard.protocol import NotifyRequest, StatusRequest
from test_adversarial_requests import other_user  # noqa: F401 (fixture)
from test_run_supervisor import JOB, RUN, finished

from spotguard_daemon.proctree import descendants

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="a PID namespace needs root and unshare")
CONTAINER = ["unshare", "--pid", "--fork", "--mount-proc"]
NAMES = """
import json, sys, zmq
sock = zmq.Context().socket(zmq.REQ); sock.connect(sys.argv[1])
sock.send(json.dumps({"type": "register", "pid": int(sys.argv[2])}).encode())
assert sock.poll(10000), "no reply"
print(sock.recv().decode(), flush=True)
"""
WATCHED = """
import pathlib, signal, sys, time
signal.signal(signal.SIGUSR1, lambda *a: pathlib.Path(sys.argv[1]).write_text("usr1"))
print("ready", flush=True)
time.sleep(60)
"""

SHELL_JOB = """
n=$(cat "$1/n" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$1/n"
[ $n -ge 2 ] && exit 0
trap 'echo USR1 > "$1/got"; exit 75' USR1
while :; do sleep 0.05; done
"""
"""A job in sh (the test's Python lives where the other user cannot run it): its first launch
traps SIGUSR1 and exits 75 on it, the second exits 0."""


def host_pid(root: int, own: int) -> int | None:
    """The pid, in this namespace, of the process below ``root`` whose own pid is ``own``."""
    for pid in descendants(root):
        try:
            nspid = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("NSpid:")][0].split()
        except (OSError, IndexError):
            continue
        if int(nspid[-1]) == own and len(nspid) > 2:
            return pid
    return None


def wait_for(what, timeout: float = 20.0, why: str = ""):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, why
        time.sleep(0.02)
    return got


def test_as_pid_1_it_reaps_orphans_and_its_job_gets_the_daemon_signal(tmp_path, daemon_factory):
    daemon = daemon_factory()
    job = tmp_path / "job"
    job.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)}
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([*CONTAINER, *RUN, "--json", "--", sys.executable, str(JOB), str(job),
                                 "--orphan"], env=env, stdout=out, stderr=err)
    why = lambda: (tmp_path / "err").read_text()  # noqa: E731
    try:
        wait_for(lambda: (job / "ready-1").exists(), why=why())
        orphan = wait_for(lambda: host_pid(proc.pid, int((job / "orphan").read_text())), why=why())
        wait_for(lambda: not Path(f"/proc/{orphan}").exists(), why="the orphan was never reaped")
        wait_for(lambda: daemon.request(StatusRequest()).data["clients"], why=daemon.output()[-2000:])
        assert daemon.request(NotifyRequest(deadline_seconds=60)).ok
        assert wait_for(lambda: (job / "got-1").exists(), why=daemon.output()[-2000:])
    finally:
        status, figures = finished(proc, tmp_path / "out", 30)
    assert status == 0 and figures["launches"] == 2 and figures["preemptions"] == 1, why()


def test_a_client_in_a_container_cannot_name_a_host_process(tmp_path, daemon_factory):
    daemon = daemon_factory()
    victim = subprocess.Popen([sys.executable, "-c", WATCHED, str(tmp_path / "victim-got")],
                              stdout=subprocess.PIPE)
    try:
        assert victim.stdout.readline() == b"ready\n"
        done = subprocess.run([*CONTAINER, sys.executable, "-c", NAMES, daemon.request_endpoint,
                               str(victim.pid)], capture_output=True, text=True, timeout=60)
        reply = json.loads(done.stdout)
        assert not reply["ok"] and "below the sender" in reply["error"], reply
        assert daemon.request(StatusRequest()).data["clients"] == []
        assert daemon.request(NotifyRequest(deadline_seconds=60)).ok
        wait_for(lambda: "sent SIGUSR1 to 0 of 0 processes" in daemon.output(), 10, daemon.output())
        assert victim.poll() is None and not (tmp_path / "victim-got").exists()
    finally:
        victim.kill()
        victim.wait(10)


def test_a_user_registers_its_own_job_and_no_other_process_of_its_own(other_user, sock_dir, tmp_path, ask):
    """The systemd unit's set-up (the daemon as a user with CAP_KILL): ``spotguard run`` as that
    user gets its job registered and signalled; a process of the same user that is not below the
    sender is refused and never signalled."""
    uid, gid = other_user
    os.chown(sock_dir, uid, gid)
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           "HOME": str(sock_dir), "SPOTGUARD_RUNTIME_DIR": f"{sock_dir}/run",
           "SPOTGUARD_STATE_DIR": f"{sock_dir}/state", "SPOTGUARD_METRICS__ENABLED": "false"}
    endpoint, job = f"ipc://{sock_dir}/run/requests.sock", sock_dir / "job"
    procs = [subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                               "--inh-caps=+kill", "--ambient-caps=+kill", "--", sys.executable, "-m",
                               "spotguard_daemon", "daemon", "--platform", "none"], env=env,
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "daemon.log", "w"))]
    try:
        wait_for(lambda: ask(endpoint, StatusRequest(), 0.5), why=(tmp_path / "daemon.log").read_text())
        stranger = subprocess.Popen([*as_user, sys.executable, "-c", WATCHED, f"{sock_dir}/stranger-got"],
                                    env=env, stdout=subprocess.PIPE)
        procs.append(stranger)
        assert stranger.stdout.readline() == b"ready\n"
        named = subprocess.run([*as_user, sys.executable, "-c", NAMES, endpoint, str(stranger.pid)],
                               env=env, capture_output=True, text=True, timeout=60)
        reply = json.loads(named.stdout)
        assert not reply["ok"] and "neither the sender nor one of its descendants" in reply["error"]
        job.mkdir()
        os.chown(job, uid, gid)
        run = subprocess.Popen([*as_user, *RUN, "--", "sh", "-c", SHELL_JOB, "job", str(job)], env=env,
                               stderr=open(tmp_path / "run.err", "w"))
        procs.append(run)
        wait_for(lambda: ask(endpoint, StatusRequest()).data["clients"], why=(tmp_path / "run.err").read_text())
        assert ask(endpoint, NotifyRequest(deadline_seconds=60)).ok
        assert run.wait(30) == 0, (tmp_path / "run.err").read_text()
        assert (job / "got").read_text() == "USR1\n" and (job / "n").read_text() == "2\n"
        assert not (sock_dir / "stranger-got").exists()
    finally:
        for proc in reversed(procs):
            proc.kill()
            proc.wait(10)
