"""Issue 12: a real daemon uploads through a TCP fault proxy to each emulator and is SIGKILLed mid-upload.

Several jobs commit checkpoints while the proxy cycles every fault mode (resets mid-body, 503s,
trickle, stalls, truncation) and the daemon is SIGKILLed mid-upload after each round and restarted. Once the faults stop,
within a bound, each job's newest checkpoint is durable, every checkpoint retention keeps restores
byte-identically, no manifest in the bucket is torn, and the upload worker never died.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
from spotguard.protocol import CommitRequest, StatusRequest
from spotguard.storage import Durable

from conftest import azurite_connection_string
from tcp_fault_proxy import MODES, TcpFaultProxy
from test_transport_faults import EMULATOR, assert_no_torn_manifest

sys.path.append(str(Path(__file__).resolve().parents[1] / "daemon"))
from test_adversarial_uploads import write_ckpt  # noqa: E402  (one engine layout for every test)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
JOBS = ("a", "b", "c")
KILLS = 3  # one after every round: the newest steps survive only in the journal
DURABLE_WITHIN = 120.0  # a stalled connection costs the store's 20 s read timeout per attempt


def daemon_env(direct, backend: str, endpoint: str) -> dict[str, str]:
    """The daemon's storage settings for ``direct``'s bucket reached through ``endpoint``."""
    bucket = direct.url.split("/")[2]
    env = {"SPOTGUARD_STORAGE__KEEP": "2", "SPOTGUARD_STORAGE__CONCURRENCY": "2"}
    if backend == "azure":
        return {**env, "SPOTGUARD_STORAGE__URL": f"az://{bucket}/pre",
                "SPOTGUARD_STORAGE__AZURE_CONNECTION_STRING": azurite_connection_string(endpoint)}
    scheme = "s3" if backend == "s3" else "gs"
    return {**env, "SPOTGUARD_STORAGE__URL": f"{scheme}://{bucket}/pre", "SPOTGUARD_STORAGE__ENDPOINT_URL": endpoint}


def cycle_modes(proxy: TcpFaultProxy, stop: threading.Event, period: float = 0.7) -> threading.Thread:
    def run() -> None:
        i = 0
        while not stop.wait(period):
            proxy.mode = MODES[i % len(MODES)]
            i += 1
        proxy.mode = None
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_until(check, what: str, daemon, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout}s: {daemon.output()[-3000:]}")


@pytest.mark.parametrize("backend", ["s3", "gcs", "azure"])
def test_sigkilled_daemon_behind_faults_makes_every_kept_checkpoint_durable(backend, request, new_bucket,
                                                                           daemon_factory, tmp_path):
    direct = new_bucket(backend)
    written: dict[tuple[str, int], dict[str, bytes]] = {}
    with TcpFaultProxy(request.getfixturevalue(EMULATOR[backend]).url) as proxy:
        env = daemon_env(direct, backend, proxy.url)
        daemon = daemon_factory(env=env)
        stop = threading.Event()
        cycler = cycle_modes(proxy, stop)
        for round_ in range(KILLS):
            for step in (2 * round_ + 1, 2 * round_ + 2):
                for job in JOBS:
                    files = {"w.bin": os.urandom(300_000), "sub/o.bin": os.urandom(40_000)}
                    written[job, step] = files
                    ckpt = write_ckpt(daemon.checkpoint_root / job, step, files, job=job)
                    reply = daemon.request(CommitRequest(pid=os.getpid(), job_id=job, path=str(ckpt), step=step))
                    assert reply.ok, reply.error
                time.sleep(1.0)
            busy = daemon.request(StatusRequest()).data["uploads"]
            assert busy["uploading"] or busy["pending"], "nothing in flight: the kill would prove nothing"
            daemon.kill()  # SIGKILL, mid-upload: the proxy keeps every upload slow or failing
            daemon = daemon_factory(env=env)
        stop.set()
        cycler.join(5)
        assert proxy.faulted, "no connection was faulted: the test proves nothing"
        healed = time.monotonic()
        newest = 2 * KILLS
        store = Durable(direct)
        wait_until(lambda: all(store.latest(job) == newest for job in JOBS), "every job's newest step",
                   daemon, DURABLE_WITHIN)
        print(f"{backend}: all durable {time.monotonic() - healed:.1f}s after the faults stopped")
        # Retention runs after the pointer is written, and is retried if the faults failed it.
        wait_until(lambda: all(len(store.list(job)) <= 2 for job in JOBS), "retention to keep 2", daemon, 60)
        worker = daemon.request(StatusRequest()).data["uploads"]["worker"]
    assert worker == {"alive": True, "restarts": 0}, worker
    assert daemon.proc.poll() is None
    assert_no_torn_manifest(direct)
    for job in JOBS:
        kept = store.list(job)
        assert newest in kept and len(kept) <= 2, kept
        for step in kept:
            restored = store.restore(job, tmp_path / "fresh" / job / str(step), step=step)
            for rel, data in written[job, step].items():
                assert (restored / rel).read_bytes() == data, (job, step, rel)
