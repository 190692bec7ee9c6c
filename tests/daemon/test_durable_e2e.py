"""Commits made durable by a real daemon process: the durable event, status, and a SIGKILL mid-upload."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import zmq
from spotguard.protocol import CommitRequest, StatusRequest, decode_event
from spotguard.storage.durable import Durable
from spotguard.storage.file import FileStore


def commit_dir(root, step: int, files: dict[str, bytes]):
    """A committed local checkpoint in the engine's layout (manifest written last, then rename)."""
    name = f"step-{step:010d}"
    tmp = root / f".tmp-{name}-1"
    tmp.mkdir(parents=True)
    for rel, data in files.items():
        (tmp / rel).write_bytes(data)
    table = {rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in files.items()}
    (tmp / "manifest.json").write_text(json.dumps({
        "format": "spotguard-checkpoint", "version": 1, "step": step, "epoch": None,
        "created": time.time(), "job_id": "job", "world_size": 1, "files": table}))
    os.rename(tmp, root / name)
    return root / name


def wait_durable(sub, step: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(200):
            topic, body = sub.recv_multipart()
            event = decode_event(body)
            if topic == b"durable" and event.step == step:
                return event.model_dump()
    raise AssertionError(f"no durable event for step {step} within {timeout}s")


def subscribe(ctx, endpoint):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"durable")
    sub.connect(endpoint)
    time.sleep(0.3)  # slow joiner: let the subscription reach the daemon
    return sub


def test_a_commit_becomes_durable_and_is_announced(daemon_factory, tmp_path):
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    ckpt = commit_dir(daemon.checkpoint_root, 10, {"w.bin": b"w" * 4096})
    with zmq.Context() as ctx, subscribe(ctx, daemon.pub_endpoint) as sub:
        reply = daemon.request(CommitRequest(pid=os.getpid(), job_id="job", path=str(ckpt), step=10))
        assert reply.ok, reply.error
        event = wait_durable(sub, 10)
    assert event["job_id"] == "job" and event["location"].endswith("step-0000000010.json")
    assert Durable(FileStore(bucket)).latest("job") == 10
    status = daemon.request(StatusRequest()).data
    assert status["uploads"]["durable"]["job"]["step"] == 10
    human = subprocess.run([sys.executable, "-m", "spotguard_daemon", "status"], capture_output=True,
                           text=True, env={**os.environ, "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)})
    assert human.returncode == 0, human.stderr
    assert f"durable store: file://{bucket}; queued: none; bytes pending: 0" in human.stdout
    assert "job job: step 10 durable" in human.stdout


def test_a_daemon_killed_mid_upload_finishes_after_restart_without_resending(daemon_factory, tmp_path):
    bucket = tmp_path / "bucket"
    files = {f"t{i}.bin": bytes([i]) * 1_000_000 for i in range(6)}
    slow = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}",
                               "SPOTGUARD_STORAGE__BANDWIDTH_MBPS": "1", "SPOTGUARD_STORAGE__CONCURRENCY": "1"})
    ckpt = commit_dir(slow.checkpoint_root, 20, files)
    assert slow.request(CommitRequest(pid=os.getpid(), job_id="job", path=str(ckpt), step=20)).ok
    objects = bucket / "objects" / "sha256"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(list(objects.glob("*"))) < 2:
        time.sleep(0.05)
    slow.kill()
    before = {p.name: p.stat().st_mtime_ns for p in objects.glob("*")}
    assert 2 <= len(before) < len(files), "the upload was not caught mid-way"
    assert Durable(FileStore(bucket)).latest("job") is None  # nothing visible yet: no torn checkpoint

    fast = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Durable(FileStore(bucket)).latest("job") != 20:
        time.sleep(0.1)
    assert Durable(FileStore(bucket)).latest("job") == 20, fast.output()
    after = {p.name: p.stat().st_mtime_ns for p in objects.glob("*")}
    assert {name: after[name] for name in before} == before  # objects sent before the kill: not resent
    assert Durable(FileStore(bucket)).verify("job", 20) == []
    assert "resuming 1 journaled upload" in fast.output()


def test_the_client_is_told_and_can_ask_which_step_is_durable(daemon_factory, tmp_path):
    from spotguard import Guard

    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{tmp_path / 'bucket'}"})
    guard = Guard(job_id="job", pub_endpoint=daemon.pub_endpoint, request_endpoint=daemon.request_endpoint)
    try:
        deadline = time.monotonic() + 10
        while not guard.daemon_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.durable_step() is None
        ckpt = commit_dir(daemon.checkpoint_root, 30, {"w.bin": b"w" * 100})
        assert daemon.request(CommitRequest(pid=os.getpid(), job_id="job", path=str(ckpt), step=30)).ok
        while guard.durable_step() != 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.durable_step() == 30  # told by the durable event
    finally:
        guard.close()
    late = Guard(job_id="job", pub_endpoint=daemon.pub_endpoint, request_endpoint=daemon.request_endpoint)
    try:
        assert late.durable_step() == 30  # a new process asks the daemon's status
    finally:
        late.close()


def scrape(daemon) -> dict[str, float]:
    """The daemon's /metrics, read over HTTP from the URL its status reply gives."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(daemon.request(StatusRequest()).data["metrics"], timeout=5) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_last_durable_step_and_its_age_survive_a_daemon_restart(daemon_factory, tmp_path):
    env = {"SPOTGUARD_STORAGE__URL": f"file://{tmp_path / 'bucket'}"}
    first = daemon_factory(env=env)
    with zmq.Context() as ctx, subscribe(ctx, first.pub_endpoint) as sub:
        ckpt = commit_dir(first.checkpoint_root, 40, {"w.bin": b"w" * 100})
        assert first.request(CommitRequest(pid=os.getpid(), job_id="job", path=str(ckpt), step=40)).ok
        wait_durable(sub, 40)
    before = scrape(first)
    assert before["spotguard_upload_last_durable_step"] == 40
    assert first.stop() == 0
    second = daemon_factory(env=env)  # same state directory: the journal of the first
    after = scrape(second)
    assert after["spotguard_upload_last_durable_step"] == 40, second.output()
    age = after["spotguard_upload_last_durable_age_seconds"]
    assert age == age and age >= before["spotguard_upload_last_durable_age_seconds"]  # not NaN, not reset


def test_human_status_names_a_refused_checkpoint_and_the_upload_worker(daemon_factory, tmp_path):
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{tmp_path / 'bucket'}"})
    ckpt = commit_dir(daemon.checkpoint_root, 50, {"w.bin": b"w" * 100})
    (ckpt / "w.bin").unlink()
    os.mkfifo(ckpt / "w.bin")  # not a regular file: the upload queue refuses it
    assert daemon.request(CommitRequest(pid=os.getpid(), job_id="job", path=str(ckpt), step=50)).ok
    deadline = time.monotonic() + 30
    while not daemon.request(StatusRequest()).data["uploads"]["refused"] and time.monotonic() < deadline:
        time.sleep(0.1)
    human = subprocess.run([sys.executable, "-m", "spotguard_daemon", "status"], capture_output=True,
                           text=True, env={**os.environ, "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)})
    assert human.returncode == 0, human.stderr
    assert f"job job: step 50 REFUSED ({ckpt}): " in human.stdout, human.stdout
    assert "upload worker: alive, restarts: 0; journal: ok" in human.stdout
