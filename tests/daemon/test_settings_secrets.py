"""Secrets never leave the daemon (issue 8 §3, issue 12.13).

A real daemon at DEBUG with a webhook URL holding a password and a ``?token=``, a webhook secret, an
Azure connection string with an AccountKey and AWS keys in the environment. A real notice goes to a
real webhook receiver and to a failing hook that prints a credential (logged by the daemon), (which must get the secret: it is used, just never shown); then every output is
searched for every secret: the daemon's log, ``status --json``, ``--print-config``, the
invalid-setting errors and every file in the state and runtime directories.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from spotguard.protocol import NotifyRequest, StatusRequest

pytestmark = pytest.mark.slow

SPOTGUARD = str(Path(sys.executable).parent / "spotguard")
ACCOUNT_KEY = "c2VjcmV0LWFjY291bnQta2V5LVM0eHg="  # base64, as a real AccountKey is
SECRETS = ["hookpass-S1x", "tok-S2x", "whsec-S3x", ACCOUNT_KEY, "AKIAS5XTESTKEY", "awssecret-S6x",
           "awstoken-S7x", "peersecret-S8x-of-the-ring"]


class Receiver(BaseHTTPRequestHandler):
    got: list[dict] = []

    def do_POST(self):  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Receiver.got.append({"auth": self.headers.get("Authorization"), "body": body})
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    Receiver.got = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def environment(sock_dir: Path, tmp: Path, port: int) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "AWS_"))}
    return clean | {
        "SPOTGUARD_RUNTIME_DIR": str(sock_dir / "run"), "SPOTGUARD_STATE_DIR": str(tmp / "state"),
        "SPOTGUARD_CHECKPOINT_ROOT": str(tmp), "SPOTGUARD_PLATFORM": "none",
        "SPOTGUARD_METRICS__PORT": "0", "SPOTGUARD_LOG_LEVEL": "DEBUG",
        "SPOTGUARD_DELIVERY__SIGNAL": "none", "SPOTGUARD_DELIVERY__ATTEMPTS": "1",
        # a user's hook that fails and prints credentials: its stderr goes into the daemon's log
        "SPOTGUARD_DELIVERY__HOOK": json.dumps(["sh", "-c", "echo cannot use $AWS_SECRET_ACCESS_KEY >&2; exit 3"]),
        "SPOTGUARD_DELIVERY__WEBHOOK": f"http://hookuser:hookpass-S1x@127.0.0.1:{port}/hook?token=tok-S2x",
        "SPOTGUARD_DELIVERY__WEBHOOK_SECRET": "whsec-S3x",
        "SPOTGUARD_STORAGE__AZURE_CONNECTION_STRING": (
            "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            f"AccountKey={ACCOUNT_KEY};BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;"),
        "AWS_ACCESS_KEY_ID": "AKIAS5XTESTKEY", "AWS_SECRET_ACCESS_KEY": "awssecret-S6x",
        "AWS_SESSION_TOKEN": "awstoken-S7x",
        # the peer tier: a listener on loopback and a partner that is not there (its failures are logged)
        "SPOTGUARD_PEER__SECRET": "peersecret-S8x-of-the-ring", "SPOTGUARD_PEER__LISTEN": "127.0.0.1:0",
        "SPOTGUARD_PEER__PARTNERS": "http://127.0.0.1:9",
    }


def leaks(text: str | bytes, where: str) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return [f"{secret} in {where}" for secret in SECRETS if secret in text]


def run_daemon_and_collect(env: dict, tmp: Path, ask) -> dict[str, str]:
    """Start the daemon, raise a notice (webhook delivered), ask status; return every output."""
    log = tmp / "daemon.log"
    endpoint = f"ipc://{env['SPOTGUARD_RUNTIME_DIR']}/requests.sock"
    with open(log, "wb") as out:
        proc = subprocess.Popen([SPOTGUARD, "daemon"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 40
        while ask(endpoint, StatusRequest(), timeout=0.5) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        assert ask(endpoint, NotifyRequest(deadline_seconds=600, detail="secrets drill")).ok
        while not (Receiver.got and "hook exited 3" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the webhook delivered, the hook failed and was logged
        status = subprocess.run([SPOTGUARD, "status", "--json"], env=env, capture_output=True, text=True,
                                timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert status.returncode == 0, status.stderr
    return {"daemon log": log.read_text(), "status --json": status.stdout + status.stderr}


def test_no_secret_in_logs_status_config_or_state(sock_dir, tmp_path, receiver, ask):
    env = environment(sock_dir, tmp_path, receiver)
    outputs = run_daemon_and_collect(env, tmp_path, ask)
    assert Receiver.got and Receiver.got[0]["auth"], "the webhook was called, with its credentials"
    config = subprocess.run([SPOTGUARD, "daemon", "--print-config"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert config.returncode == 0, config.stderr
    outputs["--print-config"] = config.stdout + config.stderr
    found = [leak for where, text in outputs.items() for leak in leaks(text, where)]
    for directory in (tmp_path / "state", sock_dir / "run"):
        files = [p for p in directory.rglob("*") if p.is_file()]
        found += [leak for p in files for leak in leaks(p.read_bytes(), str(p))]
    assert found == [], found
    shown = json.loads(config.stdout)
    assert shown["log_level"] == "DEBUG" and "cannot use ***" in outputs["daemon log"]
    assert shown["delivery"]["webhook"].startswith("http://hookuser:***@127.0.0.1")  # the password masked


@pytest.mark.parametrize("name, value", [
    ("SPOTGUARD_DELIVERY__WEBHOOK", "htp://hookuser:hookpass-S1x@127.0.0.1/hook?token=tok-S2x"),
    ("SPOTGUARD_STORAGE__URL", "ftp://user:hookpass-S1x@host/dir?sig=tok-S2x"),
    ("SPOTGUARD_STORAGE__URL", "s3://user:hookpass-S1x@bucket/dir?sig=tok-S2x"),
    ("SPOTGUARD_STORAGE__ENDPOINT_URL", "127.0.0.1:9000/?token=tok-S2x"),
    ("SPOTGUARD_STORAGE__ENDPOINT_URL", "http://127.0.0.1:9000/?token=tok-S2x"),
    ("SPOTGUARD_AWS__ENDPOINT", "http://user:hookpass-S1x@127.0.0.1:9000/"),
])
def test_an_invalid_setting_error_shows_no_secret(tmp_path, name, value):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    result = subprocess.run([SPOTGUARD, "daemon", "--runtime-dir", str(tmp_path / "run")],
                            env=clean | {name: value}, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert leaks(result.stdout + result.stderr, "the error") == [], result.stderr
