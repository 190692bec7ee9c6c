"""Shared fixtures: a short socket directory and a real daemon subprocess.

``ipc://`` paths are limited to about 107 bytes, longer than pytest's ``tmp_path`` can be, so the
sockets live in a short directory under /tmp; everything else lives in ``tmp_path``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq
from spotguard.protocol import Reply, StatusRequest, decode_reply, encode


@pytest.fixture
def sock_dir():
    path = Path(tempfile.mkdtemp(prefix="sg-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ask(endpoint: str, message, timeout: float = 5.0) -> Reply | None:
    """One request over a fresh REQ socket; None when nothing answered within ``timeout``."""
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(message if isinstance(message, bytes) else encode(message))
        return decode_reply(sock.recv()) if sock.poll(int(timeout * 1000)) else None


class DaemonProcess:
    """``python -m spotguard_daemon daemon`` with its own runtime, state and checkpoint directories."""

    def __init__(self, sock_dir: Path, tmp: Path, *args: str, env: dict | None = None) -> None:
        self.runtime_dir, self.state_dir, self.checkpoint_root = sock_dir / "run", tmp / "state", tmp / "ckpt"
        self.checkpoint_root.mkdir(parents=True, exist_ok=True)
        self.args = ["--platform", "none", "--runtime-dir", str(self.runtime_dir), "--state-dir",
                     str(self.state_dir), "--checkpoint-root", str(self.checkpoint_root),
                     "--metrics-port", "0", *args]
        # The legacy-Preemptible watcher (on against the GCP simulator, which says preemptible) counts
        # the 24 h cap from this host's boot: on a host up 23 h 50 min or more, every GCP test would
        # see a walltime notice first. Its own tests set it; test_watchers_gcp drives it directly.
        self.env = {**os.environ, "SPOTGUARD_ZMQ__HEARTBEAT_INTERVAL": "0.2", "SPOTGUARD_GCP__PREEMPTIBLE": "no",
                    **(env or {})}
        self.log = tmp / f"daemon-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def request_endpoint(self) -> str:
        return self.env.get("SPOTGUARD_ZMQ__REQUEST_ENDPOINT") or f"ipc://{self.runtime_dir}/requests.sock"

    @property
    def pub_endpoint(self) -> str:
        return self.env.get("SPOTGUARD_ZMQ__PUB_ENDPOINT") or f"ipc://{self.runtime_dir}/events.sock"

    def start(self, timeout: float = 15.0) -> "DaemonProcess":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "spotguard_daemon", "daemon", *self.args],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"daemon exited {self.proc.returncode}: {self.output()}"
            if ask(self.request_endpoint, StatusRequest(), timeout=0.5) is not None:
                return self
        raise AssertionError(f"daemon did not answer within {timeout}s: {self.output()}")

    def request(self, message, timeout: float = 5.0) -> Reply:
        reply = ask(self.request_endpoint, message, timeout)
        assert reply is not None, f"daemon did not answer: {self.output()}"
        return reply

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def daemon_factory(sock_dir, tmp_path):
    """``daemon_factory(*args, env=...)`` returns a started daemon; all are killed at teardown."""
    started: list[DaemonProcess] = []

    def make(*args: str, env: dict | None = None, start: bool = True) -> DaemonProcess:
        daemon = DaemonProcess(sock_dir, tmp_path, *args, env=env)
        started.append(daemon)
        return daemon.start() if start else daemon

    yield make
    for daemon in started:
        daemon.kill()


@pytest.fixture
def simulator():
    """``simulator(platform)`` starts ``spotguard_daemon.simulator`` and returns its URL; every
    one started is stopped at teardown."""
    procs = []

    def start(platform: str) -> str:
        proc = subprocess.Popen([sys.executable, "-m", "spotguard_daemon.simulator", platform, "--port", "0"],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline()
        assert "listening on" in line, line
        return line.split("listening on ", 1)[1].split()[0]

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(name="ask")
def ask_fixture():
    """The :func:`ask` helper, as a fixture (conftest modules are not importable by name)."""
    return ask
