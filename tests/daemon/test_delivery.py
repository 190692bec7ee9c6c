"""Delivery: signals to real processes, the hook as a real subprocess, the webhook to a real server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from spotguard.protocol import Kind, Notice
from spotguard_daemon.core.delivery import Delivery, listed_pids, signal_pids
from spotguard_daemon.core.settings import DeliverySettings

from _recorder import start_recorder


NOTICE = Notice(id="n1", platform="aws", kind=Kind.TERMINATE)


@pytest.fixture
def recorder(tmp_path):
    """A real child process that writes ``usr1`` into a file when it gets SIGUSR1."""
    procs = []

    def start(name: str = "got"):
        out = tmp_path / name
        proc = start_recorder(out)
        procs.append(proc)
        return proc, out

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def wait_for_file(path, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if path.exists():
            return path.read_text()
        threading.Event().wait(0.02)
    return None


def test_terminating_notice_signals_registered_and_listed_processes(recorder, tmp_path):
    (a, got_a), (b, got_b), (c, got_c) = recorder("a"), recorder("b"), recorder("c")
    pid_file = tmp_path / "train.pid"
    pid_file.write_text(f"{b.pid}\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "cgroup.procs").write_text(f"{c.pid}\n")
    settings = DeliverySettings(pid_files=[pid_file], cgroup=cgroup)

    async def main():
        Delivery(settings, registered=lambda: [a.pid]).deliver(NOTICE)

    asyncio.run(main())
    assert [wait_for_file(p) for p in (got_a, got_b, got_c)] == ["usr1"] * 3


def test_a_client_registered_without_a_handler_is_not_signalled_even_when_listed(recorder, tmp_path):
    """A Guard made outside the main thread says it has no handler (SIGUSR1 would kill it): the
    daemon leaves it out even when a pid file or the cgroup names it."""
    (a, got_a), (b, got_b) = recorder("a"), recorder("b")
    pid_file = tmp_path / "train.pid"
    pid_file.write_text(f"{a.pid}\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "cgroup.procs").write_text(f"{a.pid}\n{b.pid}\n")

    async def main():
        Delivery(DeliverySettings(pid_files=[pid_file], cgroup=cgroup), registered=list,
                 refused=lambda: [a.pid]).deliver(NOTICE)

    asyncio.run(main())
    assert wait_for_file(got_b) == "usr1" and wait_for_file(got_a, timeout=0.5) is None


def test_advisory_notices_and_signal_none_send_nothing(recorder):
    proc, got = recorder()
    advisory = Notice(id="r", platform="aws", kind=Kind.REBALANCE, terminating=False)

    async def main():
        Delivery(DeliverySettings(), registered=lambda: [proc.pid]).deliver(advisory)
        Delivery(DeliverySettings(signal="none"), registered=lambda: [proc.pid]).deliver(NOTICE)

    asyncio.run(main())
    assert wait_for_file(got, timeout=0.5) is None


def test_never_signals_init_itself_or_dead_pids(caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with caplog.at_level(logging.INFO):
        sent = signal_pids([0, 1, os.getpid(), dead.pid], signal.SIGUSR1)
    assert sent == []
    assert f"pid {dead.pid} is gone" in caplog.text and "refusing to signal pid 1" in caplog.text


def test_listed_pids_skips_unreadable_and_malformed_files(tmp_path):
    good, bad = tmp_path / "good.pid", tmp_path / "bad.pid"
    good.write_text("123\n")
    bad.write_text("not-a-pid")
    assert listed_pids([good, bad, tmp_path / "missing.pid"], None) == {123}


async def deliver_and_drain(settings: DeliverySettings, http: httpx.AsyncClient | None = None) -> list:
    """Deliver NOTICE with fast backoff, wait for the hook and webhook; return their outcomes."""
    outcomes: list[tuple[str, bool]] = []
    delivery = Delivery(settings, registered=list, http=http, backoff=0.01,
                        outcome=lambda ch, ok: outcomes.append((ch, ok)))
    delivery.deliver(NOTICE)
    await delivery.drain(timeout=20)
    return outcomes


def test_hook_gets_the_notice_json_on_stdin_and_is_retried(tmp_path):
    out, count = tmp_path / "hook.json", tmp_path / "count"
    script = ("import pathlib, sys\n"
              f"c = pathlib.Path({str(count)!r}); n = int(c.read_text()) + 1 if c.exists() else 1\n"
              "c.write_text(str(n))\n"
              f"pathlib.Path({str(out)!r}).write_bytes(sys.stdin.buffer.read())\n"
              "sys.exit(0 if n >= 2 else 3)\n")
    outcomes = asyncio.run(deliver_and_drain(
        DeliverySettings(hook=[sys.executable, "-c", script], attempts=3, signal="none")))
    assert json.loads(out.read_text())["id"] == "n1"
    assert count.read_text() == "2" and outcomes == [("hook", True)]


def test_hook_that_hangs_is_killed_at_the_timeout_and_reported():
    outcomes = asyncio.run(deliver_and_drain(DeliverySettings(
        hook=[sys.executable, "-c", "import time; time.sleep(30)"], attempts=2, timeout=0.3,
        signal="none")))
    assert outcomes == [("hook", False)]


class _Webhook(BaseHTTPRequestHandler):
    failures = 0
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append((self.headers.get("Authorization"), json.loads(body)))
        status = 500 if len(type(self).seen) <= type(self).failures else 204
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_webhook_posts_with_bearer_secret_retries_and_never_logs_the_secret(caplog):
    _Webhook.failures, _Webhook.seen = 1, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/hook"
    settings = DeliverySettings(webhook=url, webhook_secret="s3cret-token", signal="none", attempts=3)

    async def main():
        async with httpx.AsyncClient() as http:
            return await deliver_and_drain(settings, http)

    try:
        with caplog.at_level(logging.DEBUG):
            outcomes = asyncio.run(main())
    finally:
        server.shutdown()
        server.server_close()
    assert [auth for auth, _ in _Webhook.seen] == ["Bearer s3cret-token"] * 2
    assert _Webhook.seen[-1][1]["id"] == "n1" and outcomes == [("webhook", True)]
    assert "s3cret-token" not in caplog.text
