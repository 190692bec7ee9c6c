"""Hostile and unlucky checkpoints against a real daemon process and a real store.

Each hostile checkpoint is committed through the daemon's socket and must be refused by the upload
queue (named in ``status``), without blocking it: a good checkpoint committed after it, by another
job or as a newer step of the same job, becomes durable. Then a full state directory and a SIGKILL.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spotguard.protocol import CommitRequest, StatusRequest
from spotguard.storage.durable import Durable
from spotguard.storage.file import FileStore

DURABLE_WITHIN = 30.0
pytestmark = pytest.mark.slow  # each starts a daemon and a store


def write_ckpt(where: Path, step: int, files: dict[str, bytes], *, job: str, latest: bool = True,
               name: str | None = None) -> Path:
    """A committed checkpoint in the engine's layout under ``where`` (tmp dir, rename, ``latest``)."""
    name = name or f"step-{step:010d}"
    tmp = where / f".tmp-{name}-1"
    tmp.mkdir(parents=True)
    for rel, data in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    table = {rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in files.items()}
    (tmp / "manifest.json").write_text(json.dumps({
        "format": "spotguard-checkpoint", "version": 1, "step": step, "created": time.time(),
        "job_id": job, "world_size": 1, "files": table}))
    os.rename(tmp, where / name)
    if latest:
        (where / "latest").write_bytes(os.fsencode(name) + b"\n")
    return where / name


def commit(daemon, job: str, path: Path, step: int) -> None:
    reply = daemon.request(CommitRequest(pid=os.getpid(), job_id=job, path=str(path), step=step))
    assert reply.ok, reply.error


def uploads(daemon) -> dict:
    return daemon.request(StatusRequest()).data["uploads"]


def wait_until(check, what: str, daemon, timeout: float = DURABLE_WITHIN):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout}s: {daemon.output()[-3000:]}")


def durable_latest(bucket: Path, job: str) -> int | None:
    return Durable(FileStore(bucket)).latest(job)


# -------------------------------------------------------------------- one hostile checkpoint each


def _fifo(ckpt: Path, outside: Path) -> None:
    (ckpt / "w.bin").unlink()
    os.mkfifo(ckpt / "w.bin")


def _device(ckpt: Path, outside: Path) -> None:
    (ckpt / "w.bin").unlink()
    os.mknod(ckpt / "w.bin", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers


def _symlink_to_dev_zero(ckpt: Path, outside: Path) -> None:
    (ckpt / "w.bin").unlink()
    os.symlink("/dev/zero", ckpt / "w.bin")


def _symlink_out_of_root(ckpt: Path, outside: Path) -> None:
    (ckpt / "w.bin").unlink()
    os.symlink(outside, ckpt / "w.bin")


def _hard_link(ckpt: Path, outside: Path) -> None:
    (ckpt / "w.bin").unlink()
    os.link(outside, ckpt / "w.bin")


def _symlinked_parent(ckpt: Path, outside: Path) -> None:
    """``sub/`` is a symlink to a directory outside the root holding the same bytes."""
    (outside.parent / "subdir").mkdir()
    (outside.parent / "subdir" / "w.bin").write_bytes(outside.read_bytes())
    os.symlink(outside.parent / "subdir", ckpt / "sub")


def _symlinked_checkpoint_dir(ckpt: Path, outside: Path) -> Path:
    """``step-0000000001`` is a symlink to a sound checkpoint elsewhere below the root; the commit
    names the link (the daemon resolves it inside the root, so only the upload can refuse it)."""
    real = ckpt.parent / ".real"
    os.rename(ckpt, real)
    os.symlink(real.name, ckpt)
    return ckpt


def _manifest_names(entry: str):
    def edit(ckpt: Path, outside: Path) -> None:
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["files"] = {entry: manifest["files"]["w.bin"]}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return edit


def _non_utf8_name(ckpt: Path, outside: Path) -> None:
    os.rename(ckpt / "w.bin", os.fsencode(ckpt) + b"/w\xff.bin")
    _manifest_names("w\udcff.bin")(ckpt, outside)


HOSTILE = {
    "fifo": (_fifo, "not a regular file"),
    "device": (_device, "not a regular file"),
    "devzero": (_symlink_to_dev_zero, "not a regular file"),
    "symout": (_symlink_out_of_root, "not a regular file"),
    "hardlink": (_hard_link, "hard-linked"),
    "symparent": (_symlinked_parent, "not a directory below the root"),
    "symdir": (_symlinked_checkpoint_dir, "not a directory below the root"),
    "proc": (_manifest_names("/proc/self/environ"), "unusable manifest"),
    "dotdot": (_manifest_names("../../../../proc/self/environ"), "unusable manifest"),
    "nonutf8": (_non_utf8_name, "not UTF-8"),
}
if os.geteuid() != 0:
    del HOSTILE["device"]  # only root may make a device node


def test_hostile_checkpoints_are_refused_and_block_nobody(daemon_factory, tmp_path):
    """Every hostile checkpoint is refused, by the request handler or else by the upload queue (and
    then named in status); every job's next checkpoint, and another job's, is durable; nothing from
    outside the root reached the bucket."""
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    root = daemon.checkpoint_root
    secret = b"secret outside the root " * 100
    at_request: dict[str, str] = {}
    for job, (make_hostile, _) in HOSTILE.items():
        outside = tmp_path / "outside" / job / "secret.bin"
        outside.parent.mkdir(parents=True)
        outside.write_bytes(secret)
        files = {"sub/w.bin" if job == "symparent" else "w.bin": secret}
        ckpt = write_ckpt(root / job, 1, files, job=job)
        if job == "symparent":
            os.rename(ckpt / "sub", tmp_path / "discard")
        path = make_hostile(ckpt, outside) or ckpt
        reply = daemon.request(CommitRequest(pid=os.getpid(), job_id=job, path=str(path), step=1))
        if not reply.ok:
            at_request[job] = reply.error
    wait_until(lambda: set(uploads(daemon)["refused"]) | set(at_request) >= set(HOSTILE), "every refusal",
               daemon)
    for job in HOSTILE:
        commit(daemon, job, write_ckpt(root / job, 2, {"w.bin": job.encode()}, job=job), 2)
    commit(daemon, "other", write_ckpt(root / "other", 1, {"w.bin": b"other"}, job="other"), 1)

    wait_until(lambda: all(durable_latest(bucket, j) == 2 for j in HOSTILE), "every job's step 2", daemon)
    assert durable_latest(bucket, "other") == 1
    refused = uploads(daemon)["refused"]
    for job, (_, why) in HOSTILE.items():
        if job in at_request:
            assert at_request[job].startswith("commit refused:"), at_request[job]
        else:
            assert refused[job]["step"] == 1 and why in refused[job]["error"], (job, refused.get(job))
        assert Durable(FileStore(bucket)).list(job) == [2]
    secret_key = hashlib.sha256(secret).hexdigest()
    assert not (bucket / "objects" / "sha256" / secret_key).exists()
    assert daemon.proc.poll() is None


def test_a_file_swapped_for_a_symlink_after_the_commit_is_refused(daemon_factory, tmp_path):
    """The commit is accepted while the file is sound; it is swapped before the upload reaches it."""
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}",
                                 "SPOTGUARD_STORAGE__BANDWIDTH_MBPS": "1",
                                 "SPOTGUARD_STORAGE__CONCURRENCY": "1"})
    root = daemon.checkpoint_root
    slow = write_ckpt(root / "slow", 1, {f"{i}.bin": bytes([i]) * 500_000 for i in range(4)}, job="slow")
    commit(daemon, "slow", slow, 1)
    wait_until(lambda: uploads(daemon)["uploading"], "the slow upload to start", daemon)
    swapped = write_ckpt(root / "swap", 1, {"w.bin": b"sound"}, job="swap")
    commit(daemon, "swap", swapped, 1)
    (tmp_path / "secret").write_bytes(b"sound")  # same bytes: only the link itself is wrong
    (swapped / "w.bin").unlink()
    os.symlink(tmp_path / "secret", swapped / "w.bin")
    assert uploads(daemon)["uploading"]["job_id"] == "slow", "the swap came too late to test anything"

    refused = wait_until(lambda: uploads(daemon)["refused"].get("swap"), "the refusal", daemon)
    assert "not a regular file" in refused["error"]
    commit(daemon, "swap", write_ckpt(root / "swap", 2, {"w.bin": b"good"}, job="swap"), 2)
    wait_until(lambda: durable_latest(bucket, "swap") == 2, "swap step 2", daemon)
    wait_until(lambda: durable_latest(bucket, "slow") == 1, "slow step 1", daemon)


# -------------------------------------------------------------------- a full state directory


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 512 KiB tmpfs at ``tmp_path/state`` (root only); unmounted at teardown."""
    where = tmp_path / "state"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last byte; return the filler file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as out:
        try:
            while out.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    return filler


def test_a_full_state_directory_neither_stops_uploads_nor_tears_the_journal(daemon_factory, tmp_path,
                                                                            small_tmpfs):
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    root = daemon.checkpoint_root
    commit(daemon, "job", write_ckpt(root, 1, {"w.bin": b"one"}, job="job"), 1)
    wait_until(lambda: durable_latest(bucket, "job") == 1, "step 1", daemon)
    journal = small_tmpfs / "uploads.json"
    wait_until(lambda: json.loads(journal.read_text())["durable"].get("job"), "the journal", daemon)
    before = journal.read_bytes()

    filler = fill(small_tmpfs)
    commit(daemon, "job", write_ckpt(root, 2, {"w.bin": b"two"}, job="job"), 2)
    wait_until(lambda: durable_latest(bucket, "job") == 2, "step 2 on a full disk", daemon)
    status = uploads(daemon)
    assert status["journal_ok"] is False and status["worker"] == {"alive": True, "restarts": 0}
    assert journal.read_bytes() == before  # the previous journal, whole
    assert daemon.proc.poll() is None

    filler.unlink()
    wait_until(lambda: json.loads(journal.read_text())["durable"]["job"]["step"] == 2,
               "the journal written again", daemon)
    assert uploads(daemon)["journal_ok"] is True


# -------------------------------------------------------------------- SIGKILL and reconcile


def test_commits_pending_at_sigkill_and_made_while_down_are_durable_after_restart(daemon_factory, tmp_path):
    bucket = tmp_path / "bucket"
    slow = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}",
                               "SPOTGUARD_STORAGE__BANDWIDTH_MBPS": "1",
                               "SPOTGUARD_STORAGE__CONCURRENCY": "1"})
    root = slow.checkpoint_root
    big = {f"{i}.bin": bytes([i]) * 500_000 for i in range(6)}
    commit(slow, "a", write_ckpt(root / "a", 1, big, job="a"), 1)
    commit(slow, "b", write_ckpt(root / "b", 1, {"w.bin": b"b1"}, job="b"), 1)
    wait_until(lambda: uploads(slow)["uploading"], "an upload to start", slow)
    slow.kill()
    write_ckpt(root / "c", 4, {"w.bin": b"c4"}, job="c")  # committed while no daemon runs
    write_ckpt(root / "a", 2, {**big, "extra.bin": b"a2"}, job="a")
    write_ckpt(root / "d", 1, {"w.bin": b"d1"}, job="", latest=False)  # not committed: no pointer

    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    want = {"a": 2, "b": 1, "c": 4}
    wait_until(lambda: all(durable_latest(bucket, j) == s for j, s in want.items()), "every commit", daemon)
    assert durable_latest(bucket, "default") is None
    assert daemon.proc.poll() is None


# -------------------------------------------------------------------- S3 (moto)


class MotoS3:
    """``moto_server`` on 127.0.0.1 with one bucket; stopped by its pid at teardown."""

    def __init__(self, tmp: Path) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        binary = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
        if not binary:
            pytest.skip("moto_server is not installed")
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}
        self.url, self.bucket = f"http://127.0.0.1:{port}", "adversarial"
        with open(tmp / "moto.log", "wb") as log:
            self.proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                                         stderr=subprocess.STDOUT)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def wait_and_create_bucket(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client().create_bucket(Bucket=self.bucket)
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.2)

    def durable(self) -> Durable:
        from spotguard.storage import StoreOptions, open_store

        return Durable(open_store(f"s3://{self.bucket}/pre", StoreOptions(endpoint_url=self.url)))


@pytest.fixture
def moto_s3(tmp_path, monkeypatch):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    server = MotoS3(tmp_path)
    try:
        server.wait_and_create_bucket()
        yield server
    finally:
        server.proc.terminate()
        server.proc.wait(10)



def test_s3_a_fifo_is_refused_and_the_next_checkpoint_is_durable(daemon_factory, tmp_path, moto_s3):
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"s3://{moto_s3.bucket}/pre",
                                 "SPOTGUARD_STORAGE__ENDPOINT_URL": moto_s3.url, **moto_s3.env})
    root = daemon.checkpoint_root
    ckpt = write_ckpt(root, 1, {"w.bin": b"w" * 1000}, job="job")
    _fifo(ckpt, tmp_path)
    commit(daemon, "job", ckpt, 1)
    refused = wait_until(lambda: uploads(daemon)["refused"].get("job"), "the refusal", daemon)
    assert "not a regular file" in refused["error"]
    commit(daemon, "job", write_ckpt(root, 2, {"w.bin": b"good"}, job="job"), 2)
    wait_until(lambda: uploads(daemon)["durable"].get("job", {}).get("step") == 2, "step 2 in S3", daemon)
    assert moto_s3.durable().latest("job") == 2


def test_during_a_notice_another_jobs_newer_checkpoint_preempts_the_upload_in_flight(daemon_factory,
                                                                                      tmp_path):
    from spotguard.protocol import NotifyRequest

    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}",
                                 "SPOTGUARD_STORAGE__BANDWIDTH_MBPS": "1",
                                 "SPOTGUARD_STORAGE__CONCURRENCY": "1"})
    root = daemon.checkpoint_root
    slow = write_ckpt(root / "slow", 1, {f"{i}.bin": bytes([i]) * 400_000 for i in range(10)}, job="slow")
    commit(daemon, "slow", slow, 1)
    wait_until(lambda: uploads(daemon)["uploading"], "the slow upload to start", daemon)
    assert daemon.request(NotifyRequest(deadline_seconds=120)).ok
    commit(daemon, "urgent", write_ckpt(root / "urgent", 7, {"w.bin": b"final"}, job="urgent"), 7)
    wait_until(lambda: durable_latest(bucket, "urgent") == 7, "the urgent checkpoint", daemon)
    assert durable_latest(bucket, "slow") is None  # it was pre-empted, not finished first
    sent = list((bucket / "objects" / "sha256").iterdir())
    assert len(sent) < 10 + 1, "the pre-empted upload sent every file before the urgent one"
    wait_until(lambda: durable_latest(bucket, "slow") == 1, "the pre-empted upload, resumed", daemon)


def test_a_checkpoint_directory_with_a_non_utf8_name_is_refused_and_status_still_encodes(daemon_factory,
                                                                                          tmp_path, ask):
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    root = daemon.checkpoint_root
    ckpt = write_ckpt(root / "j", 1, {"w.bin": b"w"}, job="j", name=os.fsdecode(b"step-\xff"))
    raw = json.dumps({"type": "commit", "pid": os.getpid(), "job_id": "j", "path": str(ckpt), "step": 1})
    reply = ask(daemon.request_endpoint, raw.encode())
    assert reply is not None and daemon.proc.poll() is None, daemon.output()[-2000:]
    if reply.ok:  # the daemon may refuse it already at the request; if not, the upload must
        refused = wait_until(lambda: uploads(daemon)["refused"].get("j"), "the refusal", daemon)
        assert "not UTF-8" in refused["error"] and "\\udcff" in refused["path"]
    commit(daemon, "j", write_ckpt(root / "j", 2, {"w.bin": b"good"}, job="j"), 2)
    wait_until(lambda: durable_latest(bucket, "j") == 2, "the next checkpoint", daemon)


def test_a_store_unusable_at_start_up_is_retried_and_the_daemon_keeps_serving(daemon_factory, tmp_path):
    blocker = tmp_path / "not-yet"
    blocker.write_text("a plain file where the store's directory must go")
    bucket = blocker / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    ckpt = write_ckpt(daemon.checkpoint_root, 1, {"w.bin": b"w"}, job="job")
    commit(daemon, "job", ckpt, 1)
    wait_until(lambda: "durable storage unusable" in daemon.output(), "the start-up error", daemon)
    wait_until(lambda: uploads(daemon)["pending"], "the failed upload queued again", daemon)
    blocker.unlink()  # the store heals
    wait_until(lambda: durable_latest(bucket, "job") == 1, "the upload after the store healed", daemon)
    wait_until(lambda: "durable storage file://" in daemon.output(), "the ready line", daemon)
    assert daemon.output().count("durable storage unusable") == 1 and daemon.proc.poll() is None
