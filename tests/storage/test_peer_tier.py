"""The peer tier's wire, over real HTTP: a daemon's peer server on loopback, parts pushed to it and
fetched back, and the attacks a partner or a stranger on the cluster network could try.

Each case plays it against the real server (threads, sockets, files) and the real client; the
checkpoints are the checkpoint engine's own."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from spotguard.checkpoint import Checkpointer
from spotguard.storage.peer import PeerClient, PeerError, job_key, sign, slot_of
from spotguard_daemon.core.peer_server import MAX_CONNECTIONS, PeerServer
from spotguard_daemon.core.replicate import Replicator

SECRET = "a-cluster-secret-of-32-characters"
JOB, SLOT = "peerjob", "ranks-2-3"


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(1 << 18, generator=g), "b": torch.randn(7, generator=g)}, "step": seed}


def committed(root: Path, steps: list[int], node: dict | None = None) -> dict[int, Path]:
    """Checkpoints of ``steps`` under ``root`` (a node-local manifest's ``node`` table added)."""
    out = {}
    with Checkpointer(root, keep=len(steps), background_nice=None, background_cpu_share=None) as ck:
        for step in steps:
            ck.save(step, state(step))
            out[step] = ck.wait().path
    if node is not None:
        for path in out.values():
            manifest = json.loads((path / "manifest.json").read_text())
            (path / "manifest.json").write_text(json.dumps({**manifest, "node": node}))
    return out


@pytest.fixture
def server(tmp_path):
    jobs = {JOB}
    peer = PeerServer(tmp_path / "held", SECRET, keep=2, timeout=10, jobs=lambda: jobs)
    host, port = peer.start("127.0.0.1", 0)
    peer.url, peer.known = f"http://{host}:{port}", jobs
    yield peer
    peer.close()


def test_a_pushed_part_is_fetched_back_and_loads_bit_identical(tmp_path, server):
    parts = committed(tmp_path / "node-b", [10, 20, 30])
    with PeerClient(server.url, SECRET, JOB) as client:
        for step, path in parts.items():
            assert client.push(SLOT, step, path) > 1 << 20
        assert client.steps(SLOT) == [20, 30]  # the newest peer.keep
        fresh = tmp_path / "node-c"
        fresh.mkdir()
        restored = client.fetch(SLOT, 30, fresh)
    assert restored == fresh / "step-0000000030" and (fresh / "latest").read_text().strip() == restored.name
    target = state(0)
    with Checkpointer(fresh) as ck:
        info = ck.load_latest(target)
    assert info.step == 30 and target["step"] == 30
    assert all(torch.equal(a, b) for a, b in zip(target["model"].values(), state(30)["model"].values()))
    assert not list(fresh.glob(".tmp-*"))


def test_a_step_pushed_again_keeps_the_held_copy_in_place_and_other_bytes_are_swapped_in(tmp_path, server):
    """A sender's retry commits a step the partner holds already: the held copy was removed before
    the new one was renamed in, and a reader (a resume) meanwhile found the step missing. The same
    manifest now leaves the held directory untouched; different bytes replace it by renames."""
    parts = committed(tmp_path / "node-b", [10])
    held = tmp_path / "held" / JOB / SLOT / "step-0000000010"
    with PeerClient(server.url, SECRET, JOB) as client:
        client.push(SLOT, 10, parts[10])
        inode = held.stat().st_ino
        client.push(SLOT, 10, parts[10])  # the same step again
        assert held.stat().st_ino == inode and client.steps(SLOT) == [10]
        other = committed(tmp_path / "node-b2", [10], node={"index": 1})  # other bytes, same step
        client.push(SLOT, 10, other[10])
        assert held.stat().st_ino != inode and client.steps(SLOT) == [10]
        assert (held / "manifest.json").read_bytes() == (other[10] / "manifest.json").read_bytes()
    assert not [p.name for p in held.parent.iterdir() if p.name.startswith(".incoming-")]


def test_strangers_and_unknown_jobs_are_refused_and_nothing_is_stored(tmp_path, server):
    parts = committed(tmp_path / "node-b", [10])
    with PeerClient(server.url, "not-the-cluster-secret-at-all", JOB) as client:
        with pytest.raises(PeerError, match="HTTP 403"):
            client.push(SLOT, 10, parts[10])
        with pytest.raises(PeerError, match="HTTP 403"):
            client.steps(SLOT)
    server.known.clear()  # no client of the job registered with this daemon
    with PeerClient(server.url, SECRET, JOB) as client:
        with pytest.raises(PeerError, match="has no client registered"):
            client.push(SLOT, 10, parts[10])
        assert client.steps(SLOT) == []
    assert not any(p.is_file() for p in (tmp_path / "held").rglob("*"))


def test_a_replayed_or_re_aimed_signature_is_refused(server):
    key = job_key(SECRET, JOB)
    path = f"/v1/{JOB}/{SLOT}"
    old = httpx.get(server.url + path, headers={"Authorization": sign(key, "GET", path, now=time.time() - 3600)})
    assert old.status_code == 403
    other = httpx.get(server.url + path, headers={"Authorization": sign(key, "GET", f"/v1/{JOB}/ranks-0-1")})
    assert other.status_code == 403
    other_job = httpx.get(server.url + f"/v1/otherjob/{SLOT}",
                          headers={"Authorization": sign(key, "GET", f"/v1/otherjob/{SLOT}")})
    assert other_job.status_code == 403  # the key is the job's: it opens no other job
    assert httpx.get(server.url + path, headers={"Authorization": sign(key, "GET", path)}).json() == {"steps": []}


@pytest.mark.parametrize("rel", ["../../escape.bin", "rank-0/../../x", "/etc/passwd", "a/b/c/d/e", ".hidden/..",
                                 "rank-0/%2e%2e/x"])
def test_paths_that_leave_the_part_are_refused(tmp_path, server, rel):
    key = job_key(SECRET, JOB)
    path = f"/v1/{JOB}/{SLOT}/10/files/{rel}"
    reply = httpx.put(server.url + path, content=b"x" * 10, headers={"Authorization": sign(key, "PUT", path)})
    assert reply.status_code in (400, 404), reply.text
    assert not (tmp_path / "escape.bin").exists() and not (tmp_path / "held" / "x").exists()
    assert [p for p in (tmp_path / "held").rglob("*") if p.is_file()] == []


def test_a_part_missing_a_file_or_with_a_forged_manifest_never_becomes_visible(tmp_path, server):
    parts = committed(tmp_path / "node-b", [10])
    body = (parts[10] / "manifest.json").read_bytes()
    key = job_key(SECRET, JOB)
    commit = f"/v1/{JOB}/{SLOT}/10/commit"
    reply = httpx.post(server.url + commit, content=body, headers={
        "Authorization": sign(key, "POST", commit), "X-Spotguard-Manifest-Mac": "0" * 64})
    assert reply.status_code == 403  # the manifest's own HMAC is wrong
    from spotguard.storage.peer import manifest_mac

    reply = httpx.post(server.url + commit, content=body, headers={
        "Authorization": sign(key, "POST", commit), "X-Spotguard-Manifest-Mac": manifest_mac(key, body)})
    assert reply.status_code == 400 and "was not sent" in reply.text  # no file was pushed
    with PeerClient(server.url, SECRET, JOB) as client:
        assert client.steps(SLOT) == []


def test_bytes_changed_on_the_partner_are_caught_and_nothing_is_committed(tmp_path, server):
    parts = committed(tmp_path / "node-b", [10])
    with PeerClient(server.url, SECRET, JOB) as client:
        client.push(SLOT, 10, parts[10])
    held = tmp_path / "held" / JOB / SLOT / "step-0000000010"
    big = max((p for p in held.rglob("*.bin")), key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())
    data[100] ^= 1
    big.write_bytes(bytes(data))
    fresh = tmp_path / "node-c"
    fresh.mkdir()
    with PeerClient(server.url, SECRET, JOB) as client, pytest.raises(PeerError, match="does not match its manifest"):
        client.fetch(SLOT, 10, fresh)
    assert os.listdir(fresh) == []  # no step, no tmp left

    # a partner that rewrites the manifest too (to match its bytes) cannot sign it with the job's key
    manifest = json.loads((held / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in list(manifest["files"].items())[:1]}
    (held / "manifest.json").write_text(json.dumps(manifest))
    with PeerClient(server.url, SECRET, JOB) as client, pytest.raises(PeerError, match="does not verify"):
        client.fetch(SLOT, 10, fresh)
    assert os.listdir(fresh) == []

    # one that holds the key and claims a part larger than the disk is refused before a byte is written
    from spotguard.storage.peer import manifest_mac

    rel = next(iter(manifest["files"]))
    manifest["files"][rel]["size"] = 1 << 43
    body = json.dumps(manifest).encode()
    (held / "manifest.json").write_bytes(body)
    (held / ".mac").write_text(manifest_mac(job_key(SECRET, JOB), body))
    with PeerClient(server.url, SECRET, JOB) as client, pytest.raises(PeerError, match="has free"):
        client.fetch(SLOT, 10, fresh)
    assert os.listdir(fresh) == []


def test_garbage_on_the_socket_and_a_flood_of_idle_connections_leave_the_server_serving(server):
    host, port = server.address
    for junk in (b"\x00\xff" * 5000, b"GET /v1/" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", b"PUT /v1/x HTTP/1.1\r\n"):
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(5)
            try:
                sock.recv(100)
            except OSError:
                pass
    threads = threading.active_count()
    idle = [socket.create_connection((host, port), timeout=5) for _ in range(MAX_CONNECTIONS + 40)]
    try:
        time.sleep(0.5)
        assert threading.active_count() - threads <= MAX_CONNECTIONS  # the rest were closed at once
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 15
    while True:  # the idle ones' threads end as their sockets close
        try:
            with PeerClient(server.url, SECRET, JOB) as client:
                assert client.steps(SLOT) == []
            break
        except PeerError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_the_replicator_copies_each_node_local_commit_to_its_partner(tmp_path, server, caplog):
    root = tmp_path / "root"
    parts = committed(root / JOB, [10, 20], node={"leader": 2, "ranks": [2, 3], "nodes": 2})
    replicator = Replicator(root, [server.url], SECRET, timeout=10, staging=tmp_path / "staging")
    try:
        replicator.submit("gone", root / "gone" / "step-0000000005", 5)  # deleted before its turn
        for step, path in parts.items():
            replicator.submit(JOB, path, step)
        deadline = time.monotonic() + 30
        while replicator.status()["replicated"].get(JOB, {}).get("step") != 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replicator.status()["replicated"][JOB]["step"] == 20
        assert 0 < replicator.time_to_copy(JOB) < 30  # the cadence's floor when it beats the bucket
        assert "peer: step 5 of job 'gone' not copied" in caplog.text  # one line, and the thread went on
        assert replicator.time_to_copy("another-job") is None
    finally:
        replicator.close()
    with PeerClient(server.url, SECRET, JOB) as client:
        assert 20 in client.steps(slot_of([3, 2]))


def test_a_daemon_whose_peer_address_is_taken_says_so_and_exits(tmp_path):
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env.update(SPOTGUARD_PEER__LISTEN=f"127.0.0.1:{port}", SPOTGUARD_PEER__SECRET=SECRET)
        done = subprocess.run([sys.executable, "-m", "spotguard_daemon", "daemon", "--platform", "none",
                               "--runtime-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"),
                               "--metrics-port", "0"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"cannot serve partners on peer.listen 127.0.0.1:{port}: Address already in use" in done.stderr
    assert SECRET not in done.stdout + done.stderr


def test_the_partners_variable_as_the_daemon_takes_it_and_a_broken_one_disables_the_tier():
    from spotguard.storage.peer import peers_from_env

    secret = {"SPOTGUARD_PEER__SECRET": SECRET}
    assert peers_from_env({**secret, "SPOTGUARD_PEER__PARTNERS": "http://a:1/, http://b:2"}) == (
        ["http://a:1", "http://b:2"], SECRET)
    assert peers_from_env({**secret, "SPOTGUARD_PEER__PARTNERS": '["http://a:1"]'}) == (["http://a:1"], SECRET)
    assert peers_from_env({"SPOTGUARD_PEER__PARTNERS": "http://a:1"}) == ([], None)  # no secret: no tier
    assert peers_from_env({**secret, "SPOTGUARD_PEER__PARTNERS": '["http://a:1"'}) == ([], None)
    assert peers_from_env({**secret, "SPOTGUARD_PEER__PARTNERS": '{"a": 1}'}) == ([], SECRET)
    assert peers_from_env({**secret, "SPOTGUARD_PEER__PARTNERS": '[1, "http://a:1"]'}) == (["http://a:1"], SECRET)


def test_the_server_serves_partners_at_the_upload_niceness(tmp_path):
    """Receiving and hashing a partner's part is background work: the serving thread, whose children
    (one per request) inherit its niceness on Linux, runs at ``storage.upload_nice``; a niced server
    still takes a part and gives it back."""
    peer = PeerServer(tmp_path / "held", SECRET, keep=2, timeout=10, jobs=lambda: {JOB}, nice=7)
    host, port = peer.start("127.0.0.1", 0)
    try:
        (serving,) = [t for t in threading.enumerate() if t.name == "spotguard-peer-server"]
        assert os.getpriority(os.PRIO_PROCESS, serving.native_id) == 7  # an absolute niceness, per thread
        parts = committed(tmp_path / "node-b", [10])
        with PeerClient(f"http://{host}:{port}", SECRET, JOB) as client:
            client.push(SLOT, 10, parts[10])
            (tmp_path / "node-c").mkdir()
            assert client.fetch(SLOT, 10, tmp_path / "node-c").name == "step-0000000010"
    finally:
        peer.close()
