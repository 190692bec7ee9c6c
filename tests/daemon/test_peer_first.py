"""Under a notice, a commit goes to the partners first and to the bucket after (issue 30).

Two real daemons, a node and its partner: the sender holds a node-local part and uploads to a
``file://`` bucket; the receiver serves the peer tier on loopback behind the storage tests' proxy,
which holds every peer request 0.4 s (a slow cluster link). Without the rule the bucket upload, far
faster here, would land first. With a notice pending whose deadline is nearer than the bucket's
known time to durable (none is known yet), the part is copied to the partner before its upload is
even queued, and the sender says why in one line; the upload follows. Without a notice both start
at once, and nothing is said."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from spotguard.protocol import CommitRequest, NotifyRequest, RegisterRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))
from storage_proxy import Proxy  # noqa: E402

SECRET, JOB = "a-ring-secret-of-this-daemon-test", "peerfirst"


def node_part(root: Path, step: int) -> Path:
    """A committed node-local part (ranks 0-1 of two nodes): six 1 MB files and its manifest."""
    files = {f"rank-0/t{i}.bin": bytes([step + i]) * 1_000_000 for i in range(6)}
    path = root / f"step-{step:010d}"
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    (path / "manifest.json").write_text(json.dumps({
        "format": "spotguard-checkpoint", "version": 1, "step": step, "created": time.time(), "job_id": JOB,
        "world_size": 4, "node": {"nodes": 2, "leader": 0, "ranks": [0, 1]},
        "files": {rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in files.items()}}))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def objects(bucket: Path) -> int:
    where = bucket / "objects"
    return sum(1 for p in where.rglob("*") if p.is_file()) if where.exists() else 0


def test_under_a_notice_the_partner_gets_the_part_before_the_bucket_upload_starts(daemon_factory, sock_dir,
                                                                                  tmp_path):
    port, bucket, other = free_port(), tmp_path / "bucket", sock_dir / "partner"
    receiver = daemon_factory("--runtime-dir", str(other), "--state-dir", str(tmp_path / "partner-state"), env={
        "SPOTGUARD_PEER__LISTEN": f"127.0.0.1:{port}", "SPOTGUARD_PEER__SECRET": SECRET,
        "SPOTGUARD_STORAGE__URL": "none", "SPOTGUARD_ZMQ__REQUEST_ENDPOINT": f"ipc://{other}/requests.sock",
        "SPOTGUARD_ZMQ__PUB_ENDPOINT": f"ipc://{other}/events.sock"})
    with Proxy(f"http://127.0.0.1:{port}", fault_rate=1.0, faults=("slow",), slow_s=0.4) as link:
        sender = daemon_factory(env={"SPOTGUARD_PEER__PARTNERS": link.url, "SPOTGUARD_PEER__SECRET": SECRET,
                                     "SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
        try:
            assert receiver.request(RegisterRequest(pid=os.getpid(), job_id=JOB, signal=False)).ok
            held = tmp_path / "partner-state" / "peer" / JOB / "ranks-0-1"

            # No notice: the upload starts at once, beside the copy.
            first = node_part(sender.checkpoint_root, 10)
            assert sender.request(CommitRequest(pid=os.getpid(), job_id=JOB, path=str(first), step=10)).ok
            deadline = time.monotonic() + 30
            while not (held / first.name / "manifest.json").exists() or objects(bucket) < 6:
                assert time.monotonic() < deadline, sender.output()
                time.sleep(0.02)
            assert "partners first" not in sender.output()

            # A notice whose deadline the bucket's time is not known to meet: the partner first.
            assert sender.request(NotifyRequest(deadline_seconds=60, detail="peer-first test")).ok
            before = objects(bucket)
            second = node_part(sender.checkpoint_root, 20)
            assert sender.request(CommitRequest(pid=os.getpid(), job_id=JOB, path=str(second), step=20)).ok
            deadline = time.monotonic() + 30
            while not (held / second.name / "manifest.json").exists():
                assert objects(bucket) == before, "the bucket upload started before the partner held the part"
                assert time.monotonic() < deadline, sender.output()
                time.sleep(0.01)
            while objects(bucket) < before + 6:  # then the upload, after the copy
                assert time.monotonic() < deadline, sender.output()
                time.sleep(0.02)
            said = [line for line in sender.output().splitlines() if "partners first" in line]
            assert len(said) == 1 and "step 20 goes to the partners first, then to the bucket: a notice leaves" in \
                said[0], sender.output()
        finally:
            sender.kill()
            receiver.kill()
