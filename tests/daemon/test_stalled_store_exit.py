"""A daemon whose store never answers still stops within seconds of SIGTERM (issue 21 item 8).

The store is a local TCP server that accepts every connection and never answers: the GCS SDK
retries inside one call for ``(connect + read timeout) x attempts`` (200 s by default). Before, the
start-up check sat in that loop on asyncio's default executor, which ``asyncio.run`` joins: the
daemon logged "daemon stopped" within a second and exited after about 193 s, having said nothing
about the store. An upload in flight to it (a transfer pool's thread) must not hold the exit either.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from test_adversarial_uploads import commit, uploads, write_ckpt




class Silent:
    """A TCP server on 127.0.0.1 that accepts connections, reads what comes, and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.slow  # waits for the check's "still trying" line (10 s)
def test_sigterm_stops_a_daemon_whose_store_never_answers_within_seconds(daemon_factory):
    silent = Silent()
    try:
        daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": "gs://never-answers/prefix",
                                     "SPOTGUARD_STORAGE__ENDPOINT_URL": f"http://127.0.0.1:{silent.port}",
                                     "SPOTGUARD_SIGNAL__MEANS": "daemon"})  # a restart: no node-stop grace
        ckpt = write_ckpt(daemon.checkpoint_root / "job", 1, {"w.bin": b"w" * 4096}, job="job")
        commit(daemon, "job", ckpt, 1)
        deadline = time.monotonic() + 30
        # The upload worker is stuck in a store call too: reading the store's latest (reconcile) or
        # uploading the commit, whichever came first.
        while "no answer to the start-up check" not in daemon.output() or \
                not (uploads(daemon)["uploading"] or uploads(daemon)["pending"]):
            assert time.monotonic() < deadline, daemon.output()[-3000:]
            time.sleep(0.1)
        assert silent.held, "the store was never contacted: the test proves nothing"
        started = time.monotonic()
        assert daemon.stop(signal.SIGTERM, timeout=60) == 0
        took = time.monotonic() - started
    finally:
        silent.close()
    output = daemon.output()
    assert took < 12, f"the daemon took {took:.1f} s to exit:\n{output[-3000:]}"
    assert "durable storage gs://never-answers/prefix: no answer to the start-up check for 10 s" in output
    assert "Traceback" not in output, output[-3000:]


POOL_STUCK = """
import logging, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from spotguard_daemon.core.abandon import exit_abandoning
logging.basicConfig(level=logging.INFO)
started = threading.Event()
ThreadPoolExecutor(2, thread_name_prefix="sdk-transfer").submit(lambda: (started.set(), time.sleep(120)))
started.wait(10)
exit_abandoning(3)
"""


def test_a_transfer_pool_thread_still_running_does_not_hold_the_exit():
    """An SDK's transfer pool (non-daemon threads, joined by the interpreter at exit) stuck in a
    request: the process still exits at once, with its status, saying what it abandoned."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", POOL_STUCK], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 20 and done.returncode == 3, done.stderr
    assert "abandoning 1 store transfer thread(s) still running at exit (sdk-transfer_0)" in done.stderr


def test_a_call_on_an_abandonable_thread_hands_back_its_result_or_its_error():
    import asyncio

    from spotguard_daemon.core.abandon import in_thread

    def fails() -> None:
        raise ValueError("the store said no")

    async def both():
        with pytest.raises(ValueError, match="the store said no"):
            await in_thread(fails, "t-fails")
        return await in_thread(lambda: 42, "t-answers")

    assert asyncio.run(both()) == 42
