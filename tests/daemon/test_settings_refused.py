"""Settings that cannot work are refused at start (issue 8 §2b, §3 binds; issue 12.8, 12.19).

The real ``spotguard`` entry point, as a subprocess: every bad value exits 2 with one line naming
the setting, no traceback, and nothing started. Also ``--version``, ``status --json`` without a
daemon, and the default checkpoint root (the daemon's start directory; when that is /, commits are
refused loudly on both sides, once per cause).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spotguard._daemon_client import DaemonLink
from spotguard.protocol import CommitRequest, StatusRequest

SPOTGUARD = str(Path(sys.executable).parent / "spotguard")


def spotguard(*args: str, env: dict | None = None, cwd: Path | None = None,
              timeout: float = 30) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    return subprocess.run([SPOTGUARD, *args], env={**clean, **(env or {})}, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


REFUSED = [
    ("SPOTGUARD_AWS__ENDPOINT", "169.254.169.254", "aws.endpoint"),
    ("SPOTGUARD_AWS__ENDPOINT", "htp://169.254.169.254", "aws.endpoint"),
    ("SPOTGUARD_GCP__ENDPOINT", "metadata.google.internal/computeMetadata/v1", "gcp.endpoint"),
    ("SPOTGUARD_AZURE__ENDPOINT", "http://", "azure.endpoint"),
    ("SPOTGUARD_ALIBABA__ENDPOINT", "ftp://100.100.100.200", "alibaba.endpoint"),
    ("SPOTGUARD_STORAGE__ENDPOINT_URL", "localhost:9000", "storage.endpoint_url"),
    ("SPOTGUARD_STORAGE__URL", "ftp://host/dir", "storage.url"),
    ("SPOTGUARD_STORAGE__URL", "s3://", "storage.url"),
    ("SPOTGUARD_STORAGE__URL", "bucket/prefix", "storage.url"),
    ("SPOTGUARD_DELIVERY__WEBHOOK", "htp://127.0.0.1/hook", "delivery.webhook"),
    ("SPOTGUARD_PLATFROM", "aws", "SPOTGUARD_PLATFROM"),
    ("SPOTGUARD_LOGLEVEL", "DEBUG", "SPOTGUARD_LOGLEVEL"),
    ("SPOTGUARD_METRICS__HOST", "0.0.0.0", "metrics.host"),
    ("SPOTGUARD_METRICS__HOST", "*", "metrics.host"),
    ("SPOTGUARD_METRICS__HOST", "[::]", "metrics.host"),
    ("SPOTGUARD_METRICS__HOST", "::", "metrics.host"),
    ("SPOTGUARD_METRICS__HOST", "node-7.example.com", "metrics.host"),
    ("SPOTGUARD_ZMQ__PUB_ENDPOINT", "tcp://*:5555", "zmq.pub_endpoint"),
    ("SPOTGUARD_ZMQ__PUB_ENDPOINT", "tcp://0.0.0.0:5555", "zmq.pub_endpoint"),
    ("SPOTGUARD_ZMQ__REQUEST_ENDPOINT", "tcp://[::]:5556", "zmq.request_endpoint"),
    ("SPOTGUARD_ZMQ__REQUEST_ENDPOINT", "tcp://node-7:5556", "zmq.request_endpoint"),
]


@pytest.mark.parametrize("name, value, where", REFUSED)
def test_a_setting_that_cannot_work_exits_2_with_one_line(tmp_path, name, value, where):
    result = spotguard("daemon", "--platform", "none", "--runtime-dir", str(tmp_path / "run"),
                       "--state-dir", str(tmp_path / "state"), env={name: value})
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and where in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "state").exists()


@pytest.mark.parametrize("env", [
    {"SPOTGUARD_METRICS__HOST": "127.0.0.2"},
    {"SPOTGUARD_METRICS__HOST": "::1"},
    {"SPOTGUARD_ZMQ__PUB_ENDPOINT": "tcp://[::1]:5555"},
    {"SPOTGUARD_ZMQ__PUB_ENDPOINT": "tcp://0.0.0.0:5555", "SPOTGUARD_ZMQ__ALLOW_REMOTE": "true"},
    {"SPOTGUARD_STORAGE__URL": "https://acct.blob.core.windows.net/container/runs"},
    {"SPOTGUARD_STORAGE__URL": "/data/durable", "SPOTGUARD_RECORD": "/tmp/record.jsonl"},
])
def test_settings_that_work_are_accepted(env):
    result = spotguard("daemon", "--print-config", env=env)
    assert result.returncode == 0, result.stderr


def test_version_flag():
    result = spotguard("--version")
    assert result.returncode == 0 and result.stdout.startswith("spotguard ") and not result.stderr


def test_status_json_without_a_daemon_prints_a_json_error(sock_dir):
    result = spotguard("status", "--json", "--timeout", "0.3", env={"SPOTGUARD_RUNTIME_DIR": str(sock_dir)})
    assert result.returncode == 1
    error = json.loads(result.stdout)
    assert error["ok"] is False and "no daemon answered" in error["error"]


class Started:
    """``spotguard daemon`` with no --checkpoint-root, started in ``cwd``."""

    def __init__(self, sock_dir: Path, tmp: Path, cwd: Path) -> None:
        self.endpoint = f"ipc://{sock_dir}/run/requests.sock"
        self.log = tmp / "daemon.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env |= {"SPOTGUARD_RUNTIME_DIR": str(sock_dir / "run"), "SPOTGUARD_STATE_DIR": str(tmp / "state"),
                "SPOTGUARD_PLATFORM": "none", "SPOTGUARD_METRICS__PORT": "0"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([SPOTGUARD, "daemon"], env=env, cwd=cwd, stdout=out,
                                         stderr=subprocess.STDOUT)

    def wait_ready(self, ask) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            if ask(self.endpoint, StatusRequest(), timeout=0.5) is not None:
                return
        raise AssertionError(f"daemon not ready: {self.log.read_text()}")

    def stop(self) -> str:
        """SIGTERM, then SIGKILL after 3 s (a daemon with a queued upload waits out its grace)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(3)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return self.log.read_text()


def test_a_daemon_without_checkpoint_root_uploads_nothing_from_its_start_directory(sock_dir, tmp_path, ask, caplog):
    """Issue 32, item 10: started in a directory holding an old committed checkpoint, the daemon
    watches no root unless one is configured: it says so in one line, queues nothing, and refuses
    commits loudly once per cause (its log and the client's)."""
    work = tmp_path / "work"
    step_dir = work / "checkpoints" / "job" / "step-0000000010"
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text('{"step": 10, "job_id": "job", "files": []}')
    (step_dir.parent / "latest").write_text("step-0000000010")
    daemon = Started(sock_dir, tmp_path, work)
    try:
        daemon.wait_ready(ask)
        uploads = ask(daemon.endpoint, StatusRequest()).data["uploads"]
        link = DaemonLink(lambda event: None, pub_endpoint=f"ipc://{sock_dir}/run/events.sock",
                          request_endpoint=daemon.endpoint, request_timeout=5.0)
        try:
            with caplog.at_level(logging.WARNING, logger="spotguard._daemon_client"):
                replies = [link.request(CommitRequest(pid=os.getpid(), path=str(step_dir), step=s))
                           for s in (10, 10, 10)]
        finally:
            link.close()
    finally:
        log = daemon.stop()
    assert not uploads.get("pending") and not uploads.get("uploading"), uploads
    assert "committed but not durable" not in log
    assert all(not r.ok and "--checkpoint-root" in r.error for r in replies), replies
    client_warnings = [r for r in caplog.records if "refused commit" in r.getMessage()]
    assert len(client_warnings) == 1 and "--checkpoint-root" in client_warnings[0].getMessage()
    refused = [line for line in log.splitlines() if "WARNING" in line and "commit refused" in line]
    assert len(refused) == 1 and "--checkpoint-root" in refused[0], log
    watching = [line for line in log.splitlines() if "watching no checkpoints" in line]
    assert len(watching) == 1 and "every commit will be refused" in watching[0], log


def test_every_variable_the_library_reads_passes_the_daemons_check():
    """A ``SPOTGUARD_*`` variable the client library reads (``SPOTGUARD_FRESH=1 spotguard run ...``)
    is not refused as a mistyped daemon setting: each is a setting or listed in CLIENT_VARIABLES."""
    import re

    from spotguard_daemon.core.settings import CLIENT_VARIABLES, Settings

    client = Path(__file__).resolve().parents[2] / "client" / "spotguard"
    read = {name for path in client.rglob("*.py")
            for name in re.findall(r"[\"'](SPOTGUARD_[A-Z_]+?)[\"']", path.read_text())}
    settings = {f"SPOTGUARD_{name.upper()}" for name in Settings.model_fields}
    unknown = {name for name in read if name not in CLIENT_VARIABLES and name.split("__")[0] not in settings}
    assert read and not unknown, f"read by the library, refused by the daemon: {sorted(unknown)}"
    done = spotguard("run", "--no-daemon", "--", sys.executable, "-c", "pass",
                     env={"SPOTGUARD_FRESH": "1", "SPOTGUARD_SAVE_EVERY": "5"})
    assert done.returncode == 0, done.stderr
