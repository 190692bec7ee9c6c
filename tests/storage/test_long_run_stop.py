"""Issue 28 item 5: SIGTERM while a part upload is in flight stops the daemon within seconds.

A real daemon uploads to the S3 emulator through the TCP fault proxy; once an upload is in flight
the proxy stalls every connection (the request is read, never answered), as a store that hangs
mid-part does. A SIGTERM (``signal.means = daemon``, a restart) must end the process within a few
seconds; the journal keeps the step pending, and a restart with the store healed makes it durable.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from spotguard.protocol import CommitRequest, StatusRequest
from spotguard.storage import Durable

from tcp_fault_proxy import TcpFaultProxy
from test_daemon_through_faults import daemon_env, wait_until

sys.path.append(str(Path(__file__).resolve().parents[1] / "daemon"))
from test_adversarial_uploads import write_ckpt  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]


def test_sigterm_mid_part_upload_exits_within_seconds_and_the_restart_finishes(request, new_bucket,
                                                                                daemon_factory):
    direct = new_bucket("s3")
    with TcpFaultProxy(request.getfixturevalue("moto").url) as proxy:
        env = {**daemon_env(direct, "s3", proxy.url), "SPOTGUARD_SIGNAL__MEANS": "daemon",
               "SPOTGUARD_STORAGE__BANDWIDTH_MBPS": "4"}
        daemon = daemon_factory(env=env)
        data = os.urandom(12 * 1024 * 1024)
        ckpt = write_ckpt(daemon.checkpoint_root / "job", 1, {"w.bin": data}, job="job")
        reply = daemon.request(CommitRequest(pid=os.getpid(), job_id="job", path=str(ckpt), step=1))
        assert reply.ok, reply.error
        wait_until(lambda: (daemon.request(StatusRequest()).data["uploads"]["uploading"] or {}).get("step") == 1,
                   "the upload to start", daemon, 30)
        time.sleep(1.0)  # inside the object's parts (4 MB/s, 12 MB)
        proxy.mode = "stall"
        time.sleep(1.0)
        started = time.monotonic()
        assert daemon.stop(signal.SIGTERM, timeout=60) == 0
        took = time.monotonic() - started
        output = daemon.output()
        assert took < 8, f"the daemon took {took:.1f} s to exit:\n{output[-3000:]}"
        assert Durable(direct).latest("job") is None
        journal = json.loads((daemon.state_dir / "uploads.json").read_text())
        assert [(u["job_id"], u["step"]) for u in journal["pending"]] == [("job", 1)], journal
        proxy.mode = None
        daemon = daemon_factory(env=env)
        wait_until(lambda: Durable(direct).latest("job") == 1, "step 1 durable after the restart", daemon, 60)
    print(f"SIGTERM to exit: {took:.2f} s")
