"""Attacks on the daemon's request side, each against a real daemon subprocess over real sockets.

Every test asserts the refusal (or the bound) and that the daemon keeps serving: a malformed flood,
a path that is not UTF-8, queue poisoning with a fake commit, a registration of someone else's pid
(a user this test creates, the daemon run as that user with ``CAP_KILL`` as the systemd unit does),
unbounded registrations and notices, shared socket directories and a subscriber that never reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import socket
import stat
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import zmq
from spotguard.protocol import (
    CommitRequest, Notice, NotifyRequest, RegisterRequest, Reply, SafeRequest, StatusRequest, decode_event, decode_reply,
    encode, utcnow,
)
from spotguard_daemon.core.handlers import MAX_MANUAL
from spotguard_daemon.core.server import Server
from spotguard_daemon.core.store import NoticeStore
from spotguard_daemon.core.watchers.manual import manual_notice

from _recorder import start_recorder
from _users import new_user

LIMIT = 4096
NO_SIGNAL = {"SPOTGUARD_DELIVERY__SIGNAL": "none", "SPOTGUARD_ZMQ__MAX_MESSAGE_BYTES": str(LIMIT)}


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A SUB socket that has seen a heartbeat, so the next event reaches it."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    next_event(sub, "heartbeat")
    return sub


def next_event(sub: zmq.Socket, topic: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if sub.poll(int(left * 1000)):
            got, data = sub.recv_multipart()
            if got == topic.encode():
                return decode_event(data)
    raise AssertionError(f"no {topic} event within {timeout}s")


def pipelined(endpoint: str, bodies: list[list[bytes]], window: int = 500) -> list[Reply]:
    """Send every message over one DEALER, ``window`` at a time, and collect the replies."""
    replies: list[Reply] = []
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        for start in range(0, len(bodies), window):
            for frames in bodies[start:start + window]:
                dealer.send_multipart(frames)
            while dealer.poll(300):
                replies.append(decode_reply(dealer.recv_multipart()[-1]))
    return replies


def assert_notice_delivered(daemon) -> None:
    """The daemon still answers status and delivers a fresh notice to a subscriber."""
    assert daemon.request(StatusRequest()).ok
    with zmq.Context() as ctx, subscribe(ctx, daemon.pub_endpoint) as sub:
        notice = daemon.request(NotifyRequest(kind="rebalance", deadline_seconds=600)).data["notice"]
        deadline = time.monotonic() + 10
        while next_event(sub, "notice").notice.id != notice["id"]:
            assert time.monotonic() < deadline
    assert daemon.proc.poll() is None


# --------------------------------------------------------------------------- fuzz


def malformed(rng: random.Random) -> list[bytes]:
    """One hostile message body (frames after the envelope)."""
    kind = rng.randrange(9)
    types = ["register", "unregister", "status", "safe", "commit", "notify", "reply", "notice", ""]
    values = [None, True, -1, 0, 2**63, 1e308, "x" * 300, [], {}, [[[]]], "\udcff", "../" * 50]
    if kind == 0:
        return [rng.randbytes(rng.randrange(300))]
    if kind == 1:  # not UTF-8
        return [b'{"type": "status", "x": "\xff\xfe' + rng.randbytes(8) + b'"}']
    if kind == 2:  # lone surrogates and hostile paths that are valid JSON
        path = rng.choice(["\\udcff", "\\u0000", "/proc/self/root", "../" * 40, ".", "/", "a" * 4000])
        return [f'{{"type": "commit", "pid": 1, "path": "{path}", "step": {rng.choice([0, 10**15])}}}'
                .encode()]
    if kind == 3:  # known types, wrong field types
        doc = {"type": rng.choice(types), rng.choice(["pid", "path", "step", "notice_ids", "kind",
                                                      "deadline_seconds", "v", "rank"]): rng.choice(values)}
        return [json.dumps(doc).encode()]
    if kind == 4:  # deep JSON, within the size limit
        return [rng.choice([b"[" * rng.randrange(500, LIMIT - 1), b'{"a":' * rng.randrange(100, 800)])]
    if kind == 5:  # over the limit (but under ZMQ_MAXMSGSIZE: an error reply, not a disconnect)
        return [b'{"type": "status", "pad": "' + b"x" * rng.randrange(LIMIT, 2 * LIMIT) + b'"}']
    if kind == 6:  # non-finite numbers
        return [rng.choice([b'{"type": "notify", "deadline_seconds": NaN}', b'{"type": "safe", "pid": Infinity}'])]
    if kind == 7:  # several frames
        return [b"{}"] * rng.randrange(2, 5)
    return [json.dumps({"type": "register", "pid": rng.randrange(1, 2**31), "job_id": "\u2603" * 10}).encode()]


@pytest.mark.slow
def test_ten_thousand_malformed_requests_then_status_and_a_delivered_notice(daemon_factory):
    daemon = daemon_factory(env=NO_SIGNAL)
    rng = random.Random(12)
    bodies = [[b"", *malformed(rng)] for _ in range(10_000)]
    replies = pipelined(daemon.request_endpoint, bodies)
    assert len(replies) >= 9_900, len(replies)  # a REQ-style envelope: every one is answered
    assert sum(not r.ok for r in replies) >= 8_000
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:  # beyond ZMQ_MAXMSGSIZE
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(daemon.request_endpoint)
        for _ in range(20):
            dealer.send_multipart([b"", b"[" * (8 * LIMIT)])
    assert_notice_delivered(daemon)
    assert "Traceback" not in daemon.output()


def test_a_path_that_is_not_utf8_is_refused_and_the_daemon_keeps_serving(daemon_factory):
    daemon = daemon_factory(env=NO_SIGNAL)
    odd = os.fsencode(daemon.checkpoint_root) + b"/\xff\xfe"
    os.makedirs(odd + b"/step-0000000001")
    Path(os.fsdecode(odd + b"/step-0000000001/manifest.json")).write_text('{"step": 1}')
    (daemon.checkpoint_root / "link").symlink_to(os.fsdecode(odd))
    for path, why in [("link/step-0000000001", "not a UTF-8 name"),  # resolves to \xff\xfe
                      (os.fsdecode(odd + b"/step-0000000001"), "valid string")]:  # sent as "\udcff"
        reply = daemon.request(json.dumps({"type": "commit", "pid": 1, "path": path, "step": 1}).encode())
        assert not reply.ok and why in reply.error, reply
    assert_notice_delivered(daemon)


def test_an_unencodable_reply_or_a_raising_handler_is_an_error_reply_logged_once(sock_dir, caplog):
    async def handler(request):
        if request.type == "status":
            return Reply(ok=True, data={"path": "/ckpt/\udcff"})
        raise RuntimeError("boom")

    server = Server(pub_endpoint=f"ipc://{sock_dir}/run/e.sock", request_endpoint=f"ipc://{sock_dir}/run/r.sock",
                    handler=handler, pending_ids=list, daemon_id="d", max_message_bytes=LIMIT)

    async def main():
        server.bind()
        task = asyncio.create_task(server.serve())
        try:
            bodies = [[b"", encode(m)] for m in [StatusRequest(), NotifyRequest()] * 50]
            return await asyncio.to_thread(pipelined, server.request_endpoint, bodies)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            server.close()

    replies = asyncio.run(main())
    assert len(replies) == 100 and not any(r.ok for r in replies)
    assert {r.error.split(";")[0] for r in replies} == {
        "internal error: the reply could not be encoded", "internal error"}
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2, [r.getMessage() for r in errors]


# --------------------------------------------------------------------------- commits


def checkpoint(root: Path, step: int, manifest_step: int | None = None) -> Path:
    """A committed checkpoint in the engine's layout (its manifest may lie about the step)."""
    path = root / "job" / f"step-{step:010d}"
    path.mkdir(parents=True)
    data = b"w" * 64
    (path / "w.bin").write_bytes(data)
    (path / "manifest.json").write_text(json.dumps({
        "format": "spotguard-checkpoint", "version": 1, "created": time.time(), "job_id": "job",
        "step": step if manifest_step is None else manifest_step, "epoch": None, "world_size": 1,
        "files": {"w.bin": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}))
    return path


def test_fake_commits_cannot_poison_the_queue(daemon_factory, tmp_path):
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{tmp_path / 'bucket'}"})
    root = daemon.checkpoint_root
    (root / "plain").write_text("x")
    os.mkfifo(root / "job-fifo")
    bare = root / "job" / "step-0000000009"
    bare.mkdir(parents=True)
    os.mkfifo(bare / "manifest.json")
    lying = checkpoint(root, 8, manifest_step=10**15)

    def commit(path, step):
        return daemon.request(CommitRequest(pid=os.getpid(), job_id="job", path=str(path), step=step))

    for path, step, why in [(root, 10**15, "not a committed checkpoint directory"),
                            (root / "plain", 10**15, "not a committed checkpoint directory"),
                            (root / "job-fifo", 1, "not a committed checkpoint directory"),
                            (bare, 9, "manifest.json is not a regular file"),
                            (lying, 8, "does not match the manifest's step"),
                            (lying, 10**15, "does not match the directory")]:
        reply = commit(path, step)
        assert not reply.ok and why in reply.error, (path, reply)
    assert commit(checkpoint(root, 5), 5).ok
    older = commit(checkpoint(root, 3), 3)
    assert not older.ok and "older than step 5" in older.error
    with zmq.Context() as ctx, subscribe(ctx, daemon.pub_endpoint) as sub:
        assert commit(checkpoint(root, 7), 7).ok
        deadline = time.monotonic() + 30
        while next_event(sub, "durable", 30).step != 7:
            assert time.monotonic() < deadline
    assert daemon.request(StatusRequest()).data["uploads"]["durable"]["job"]["step"] == 7
    assert daemon.output().count("commit refused: step 3 is older") == 1


# --------------------------------------------------------------------------- who may do what


@pytest.fixture
def other_user():
    """A user created for this test and removed after it: (uid, gid)."""
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root")
    with new_user() as ids:
        yield ids


CLIENT = """
import json, os, pathlib, signal, sys, time, zmq
endpoint, victim = sys.argv[1], int(sys.argv[2])
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
ctx = zmq.Context()
def ask(doc):
    sock = ctx.socket(zmq.REQ); sock.setsockopt(zmq.LINGER, 0); sock.connect(endpoint)
    sock.send(json.dumps(doc).encode())
    assert sock.poll(10000), "no reply"
    return json.loads(sock.recv())
print(json.dumps([ask({"type": "register", "pid": victim}), ask({"type": "safe", "pid": victim}),
                  ask({"type": "unregister", "pid": victim}),
                  ask({"type": "register", "pid": os.getpid()})]), flush=True)
deadline = time.monotonic() + 20
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print("usr1" if got else "nothing", flush=True)
"""


@pytest.mark.slow
def test_a_foreign_pid_is_refused_and_never_signalled(other_user, sock_dir, tmp_path, ask):
    """The systemd unit's set-up: the daemon runs as a user with CAP_KILL; a client of that user
    names a root-owned process. It is refused, and only the client's own process is signalled."""
    uid, gid = other_user
    os.chown(sock_dir, uid, gid)
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    caps = ["--inh-caps=+kill", "--ambient-caps=+kill"]
    endpoint = f"ipc://{sock_dir}/run/requests.sock"
    env = {**os.environ, "HOME": str(sock_dir), "SPOTGUARD_ZMQ__HEARTBEAT_INTERVAL": "0.2"}
    victim = start_recorder(tmp_path / "victim-got")  # root's
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen([*as_user, *caps, "--", sys.executable, "-m", "spotguard_daemon", "daemon",
                               "--platform", "none", "--runtime-dir", f"{sock_dir}/run", "--state-dir",
                               f"{sock_dir}/state", "--metrics-port", "0"],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while ask(endpoint, StatusRequest(), timeout=0.5) is None:
            assert daemon.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
        client = subprocess.Popen([*as_user, "--", sys.executable, "-c", CLIENT, endpoint, str(victim.pid)],
                                  env=env, stdout=subprocess.PIPE, text=True)
        try:
            register, safe, unregister, own = json.loads(client.stdout.readline())
            assert not register["ok"] and f"not a process of uid {uid}" in register["error"]
            assert own["ok"] and own["data"]["signal"] is True
            assert not safe["ok"] and "not the sender's" in safe["error"]
            assert ask(endpoint, SafeRequest(pid=victim.pid)).ok, "root may speak for any pid"
            assert ask(endpoint, NotifyRequest(deadline_seconds=60)).ok
            assert client.stdout.readline().strip() == "usr1", "the daemon can signal its user's processes"
        finally:
            stop(client)
        assert unregister["ok"] and not unregister["data"]["known"]
        assert victim.poll() is None and not (tmp_path / "victim-got").exists()
    finally:
        stop(daemon)
        stop(victim)
        log.close()


def test_tcp_registrations_are_unproven_never_signalled_and_bounded(daemon_factory, tmp_path):
    """tcp:// cannot prove who the peer is: its registrations are kept (bounded) but never signalled,
    and twenty thousand of them leave ``status`` small."""
    daemon = daemon_factory(env={"SPOTGUARD_ZMQ__REQUEST_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"})
    child = start_recorder(tmp_path / "got")
    try:
        reply = daemon.request(RegisterRequest(pid=child.pid))
        assert reply.ok and reply.data["signal"] is False
        bodies = [[b"", encode(RegisterRequest(pid=p))] for p in range(1_000_000, 1_020_000)]
        assert all(r.ok for r in pipelined(daemon.request_endpoint, bodies))
        status = daemon.request(StatusRequest())
        assert len(status.data["clients"]) == 256
        assert len(encode(status)) < 64 * 1024
        notice = daemon.request(NotifyRequest(deadline_seconds=60)).data["notice"]
        deadline = time.monotonic() + 10
        while f"notice {notice['id']}: sent SIGUSR1 to 0 of 0 processes" not in daemon.output():
            assert time.monotonic() < deadline, daemon.output()[-2000:]
            time.sleep(0.05)
        assert not (tmp_path / "got").exists()
    finally:
        stop(child)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --------------------------------------------------------------------------- bounds


def test_manual_notices_are_capped_and_dead_pids_refused(daemon_factory):
    daemon = daemon_factory(env=NO_SIGNAL)
    replies = pipelined(daemon.request_endpoint,
                        [[b"", encode(NotifyRequest(kind="drill", detail="d" * 1024))] for _ in range(40)])
    assert sum(r.ok for r in replies) == MAX_MANUAL
    assert {r.error for r in replies if not r.ok} == {f"notify refused: {MAX_MANUAL} manual notices are pending"}
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = daemon.request(RegisterRequest(pid=gone.pid))
    assert not dead.ok and "not a running process" in dead.error
    status = daemon.request(StatusRequest())
    assert len(status.data["notices"]) == MAX_MANUAL and len(encode(status)) < 1024 * 1024


def test_a_drill_without_a_deadline_expires_and_a_platform_notice_does_not():
    now = [utcnow()]
    store = NoticeStore(None, stale_after=60, clock=lambda: now[0])
    drill = manual_notice(NotifyRequest(), platform="none", now=now[0])
    platform = Notice(id="gcp:preempted", platform="gcp", kind="preempt", source="gcp",
                      received_at=now[0])
    store.add(drill)
    store.reconcile("gcp", [platform])
    now[0] += timedelta(seconds=59)
    assert store.expire() == []
    now[0] += timedelta(seconds=2)
    assert store.expire() == [drill.id]
    assert [n.id for n in store.pending()] == [platform.id]


@pytest.mark.slow
def test_a_flood_and_a_peer_that_never_reads_keep_memory_bounded(daemon_factory):
    """20,000 status requests whose replies are never read, and a subscriber that never reads:
    the daemon's memory stays bounded (high-water marks) and a valid request is still answered."""
    daemon = daemon_factory(env=NO_SIGNAL)
    for _ in range(MAX_MANUAL):
        assert daemon.request(NotifyRequest(detail="d" * 512)).ok
    before = rss_bytes(daemon.proc.pid)
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as lazy, ctx.socket(zmq.DEALER) as flood:
        for sock in (lazy, flood):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 10)
        lazy.setsockopt(zmq.SUBSCRIBE, b"")
        lazy.connect(daemon.pub_endpoint)
        flood.connect(daemon.request_endpoint)
        request = encode(StatusRequest())
        for _ in range(20_000):
            flood.send_multipart([b"", request])
        assert daemon.request(StatusRequest(), timeout=60).ok
        grown = rss_bytes(daemon.proc.pid) - before
    print(f"daemon RSS grew by {grown / 1e6:.1f} MB")
    assert grown < 100 * 1024 * 1024, f"the daemon grew by {grown / 1e6:.0f} MB"
    reply = daemon.request(StatusRequest())
    assert reply.ok and len(reply.data["notices"]) == MAX_MANUAL and daemon.proc.poll() is None


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# --------------------------------------------------------------------------- directories


def start_fails(daemon) -> str:
    """Run the daemon expecting a refusal at start; return its one-line message (log lines aside)."""
    result = subprocess.run([sys.executable, "-m", "spotguard_daemon", "daemon", *daemon.args],
                            env=daemon.env, capture_output=True, text=True, timeout=30)
    (line,) = [x for x in result.stderr.splitlines() if not x[:4].isdigit()]  # log lines: timestamps
    assert result.returncode == 1 and line.startswith("spotguard: cannot start: "), result.stderr
    return line


def test_an_ipc_endpoint_in_a_shared_directory_leaves_the_directory_alone(daemon_factory, sock_dir):
    shared, loose = sock_dir / "shared", sock_dir / "loose"
    for path, mode in ((shared, 0o1777), (loose, 0o777)):
        path.mkdir()
        os.chmod(path, mode)
    daemon = daemon_factory(env={"SPOTGUARD_ZMQ__REQUEST_ENDPOINT": f"ipc://{shared}/req.sock",
                                 "SPOTGUARD_ZMQ__PUB_ENDPOINT": f"ipc://{shared}/ev.sock"})
    assert daemon.request(StatusRequest()).ok
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(shared / "req.sock").st_mode) == 0o600
    daemon.stop()
    refused = daemon_factory(start=False, env={"SPOTGUARD_ZMQ__REQUEST_ENDPOINT": f"ipc://{loose}/req.sock"})
    assert "writable by other users without the sticky bit" in start_fails(refused)
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o777


def test_a_runtime_dir_owned_by_another_user_is_refused_in_one_line(daemon_factory):
    if os.geteuid() != 0:
        pytest.skip("giving a directory away needs root")
    daemon = daemon_factory(start=False)
    daemon.runtime_dir.mkdir(mode=0o700)
    os.chown(daemon.runtime_dir, 65534, 65534)
    assert "belongs to uid 65534" in start_fails(daemon)
    assert not (daemon.runtime_dir / "requests.sock").exists()


NS_CLIENT = """
import json, os, signal, sys, time, zmq
got = []
signal.signal(signal.SIGWINCH, lambda *a: got.append(1))
sock = zmq.Context().socket(zmq.REQ)
sock.connect(sys.argv[1])
sock.send(json.dumps({"type": "register", "pid": os.getpid()}).encode())
print(os.getpid(), sock.recv().decode(), flush=True)
deadline = time.monotonic() + 20
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print("signalled" if got else "nothing", flush=True)
"""


def test_a_client_in_its_own_pid_namespace_is_signalled_by_its_real_pid(daemon_factory):
    """A container's client registers its namespace pid (1 here): the daemon signals the process the
    kernel says sent the request, never the pid 1 of its own namespace. (SIGWINCH: harmless if not.)"""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs root")
    daemon = daemon_factory(env={"SPOTGUARD_DELIVERY__SIGNAL": "SIGWINCH"})
    client = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", NS_CLIENT,
                               daemon.request_endpoint], stdout=subprocess.PIPE, text=True)
    try:
        pid, reply = client.stdout.readline().split(" ", 1)
        assert pid == "1" and json.loads(reply)["data"]["signal"] is True, reply
        assert daemon.request(NotifyRequest(deadline_seconds=60)).ok
        assert client.stdout.readline().strip() == "signalled"
        assert "sent SIGWINCH to 1 of 1 processes" in daemon.output()
    finally:
        stop(client)


@pytest.mark.parametrize("numbers", [
    {"type": "register", "pid": os.getpid(), "rank": 0, "job_id": "victim", "resumed_from_step": 2**63},
    {"type": "register", "pid": os.getpid(), "rank": 2**63, "job_id": "victim"},
    {"type": "progress", "pid": os.getpid(), "job_id": "victim", "step": 2**63, "at": "now"},
    {"type": "progress", "pid": os.getpid(), "job_id": "victim", "step": 3, "at": "0001-01-01T00:00:00Z"},
    {"type": "commit", "pid": os.getpid(), "path": "x", "step": 1, "size_bytes": 2**64},
    {"type": "notify", "deadline_seconds": 1e308},
    {"type": "safe", "pid": 2**40},
], ids=["resumed-2**63", "rank-2**63", "progress-2**63", "progress-year-1", "size-2**64",
        "deadline-1e308", "pid-2**40"])
def test_a_number_out_of_bounds_is_refused_at_the_protocol_and_the_daemon_lives_on(daemon_factory, tmp_path,
                                                                                   numbers):
    """One register with ``resumed_from_step: 2**63`` used to be accepted; the housekeeping loop then
    failed the ledger's schema and the daemon exited 1. Every integer and time on the wire is bounded."""
    daemon = daemon_factory(env={**NO_SIGNAL, "SPOTGUARD_STORAGE__URL": f"file://{tmp_path}/store",
                                 "SPOTGUARD_STORAGE__PROGRESS_SECONDS": "0.1"})
    numbers = {k: utcnow().isoformat() if v == "now" else v for k, v in numbers.items()}
    field = next(k for k, v in numbers.items() if v in (2**63, 2**64, 2**40, 1e308, "0001-01-01T00:00:00Z"))
    reply = daemon.request(json.dumps(numbers).encode())
    assert not reply.ok and field in reply.error, reply
    largest = {**numbers, field: {"at": "2199-12-31T00:00:00Z", "deadline_seconds": 7 * 24 * 3600,
                                  "pid": os.getpid(), "rank": 2**20 - 1}.get(field, 2**53 - 1)}
    assert daemon.request(json.dumps(largest).encode()).ok or numbers["type"] == "commit"
    time.sleep(1.5)  # several housekeeping passes and progress writes, each of which used to fail
    assert daemon.proc.poll() is None, daemon.output()[-3000:]
    assert daemon.request(StatusRequest()).ok
    assert "Traceback" not in daemon.output() and "task" not in daemon.output(), daemon.output()[-3000:]
