"""Restore from a damaged or hostile bucket (issues 12.15 and 8 §3): every bad manifest or pointer
is skipped with a warning, the newest sound checkpoint is restored, nothing is written outside the
destination, no oversized object is downloaded, and nothing in the bucket is executed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle

import pytest

from spotguard.storage import Durable, IntegrityError
from spotguard.storage.durable import manifest_key, object_key


def manifest(step: int, files: dict[str, dict]) -> bytes:
    return json.dumps({"format": "spotguard-checkpoint", "version": 1, "step": step, "files": files}).encode()


def entry(data: bytes, size: int | None = None) -> dict:
    return {"size": len(data) if size is None else size, "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("backend", ["file", "s3"])  # the logic is the store's reader, not a backend's
def test_hostile_manifests_and_pointer_never_hide_the_sound_checkpoint(store, make_ckpt, tmp_path, caplog):
    durable = Durable(store)
    sound = {"w.bin": os.urandom(5000)}
    durable.upload(make_ckpt(tmp_path / "local", 2, sound), "job")
    big = os.urandom(1024 * 1024)
    store.put_bytes(object_key(hashlib.sha256(big).hexdigest()), big)
    hostile = {
        3: manifest(10 ** 9, {"w.bin": entry(b"x")}),                        # step disagrees with its key
        4: manifest(4, {"../escape.bin": entry(b"x"), "/abs.bin": entry(b"x")}),
        5: manifest(5, {"w.bin": entry(big, size=10)}),                      # object bigger than declared
        6: manifest(6, {"w.bin": entry(b"x", size=1 << 43)}),                # 8 TiB: cannot fit
        7: b"[" * 200_000 + b"]" * 200_000,                                  # nesting past the recursion limit
        8: manifest(8, {"w.bin": {"size": float("nan"), "sha256": "0" * 64}}),
    }
    for step, body in hostile.items():
        store.put_bytes(manifest_key("job", step), body)
    store.put_bytes("jobs/job/latest", b"step-1000000000\n")  # names a step that does not exist
    assert durable.latest("job") == 8  # a manifest exists; restore decides whether it is sound
    with caplog.at_level(logging.WARNING):
        restored = durable.restore("job", tmp_path / "dest" / "root")
    assert restored.name == "step-0000000002"
    assert (restored / "w.bin").read_bytes() == sound["w.bin"]
    for reason in ("its key says", "unsafe file path", "its manifest says 10", "does not fit", "corrupt manifest"):
        assert reason in caplog.text, reason
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["root"]
    assert not list((tmp_path / "dest" / "root").glob(".tmp-*"))
    assert not any(p.stat().st_size >= len(big) for p in (tmp_path / "dest").rglob("*") if p.is_file())


class _Boom:
    def __reduce__(self):
        return (open, (os.environ["SG_MARKER"], "w"))


def test_a_malicious_dcp_metadata_pickle_is_restored_as_bytes_never_run(new_bucket, make_ckpt, tmp_path,
                                                                         monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("SG_MARKER", str(marker))
    payload = pickle.dumps(_Boom())
    durable = Durable(new_bucket("file"))
    durable.upload(make_ckpt(tmp_path / "local", 1, {".metadata": payload, "__0_0.distcp": b"\0" * 64}), "job")
    restored = durable.restore("job", tmp_path / "fresh")
    assert (restored / ".metadata").read_bytes() == payload
    assert not marker.exists()


_RESTORE = """
import sys
from spotguard.storage import Durable
from spotguard.storage.file import FileStore
print(Durable(FileStore(sys.argv[1])).restore("job", sys.argv[2]).name)
"""


def _limits() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))  # a fill-the-disk bug dies of SIGXFSZ
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))       # a read-it-whole bug of MemoryError


def test_a_file_store_whose_objects_are_endless_devices_restores_the_sound_checkpoint(make_ckpt, tmp_path):
    """Issue 21.18: a ``file://`` store whose object, manifest and pointer are symlinks to /dev/zero
    (and a FIFO) is read no further than the manifest's sizes: the sound step 1 is restored, in a
    process that may write 64 MiB at most (before, the object was copied whole: the disk filled)."""
    import subprocess
    import sys

    from spotguard.storage.file import FileStore

    bucket = tmp_path / "bucket"
    durable = Durable(FileStore(bucket))
    durable.upload(make_ckpt(tmp_path / "local", 1, {"w.bin": b"1" * 4096}), "job")
    durable.upload(make_ckpt(tmp_path / "local", 2, {"w.bin": b"2" * 4096, "b.bin": b"b" * 10}), "job")
    objects = {rel: bucket / object_key(meta["sha256"]) for rel, meta in durable.manifest("job", 2)["files"].items()}
    objects["w.bin"].unlink()
    objects["w.bin"].symlink_to("/dev/zero")
    objects["b.bin"].unlink()
    os.mkfifo(objects["b.bin"])
    (bucket / manifest_key("job", 3)).symlink_to("/dev/zero")
    (bucket / "jobs/job/latest").unlink()
    (bucket / "jobs/job/latest").symlink_to("/dev/zero")
    done = subprocess.run([sys.executable, "-c", _RESTORE, str(bucket), str(tmp_path / "dest")], text=True,
                          capture_output=True, timeout=60, preexec_fn=_limits)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["step-0000000001"]
    assert "not a regular file" in done.stderr and "skipping step-0000000002" in done.stderr, done.stderr
    assert (tmp_path / "dest/step-0000000001/w.bin").read_bytes() == b"1" * 4096


def test_every_backend_reads_no_object_past_the_size_asked_for(store, tmp_path):
    store.put_bytes("objects/big", b"x" * 5000)
    with pytest.raises(IntegrityError, match="5000 bytes, its manifest says 1000|larger than the 1000"):
        store.get_file("objects/big", tmp_path / "out", max_size=1000)
    with pytest.raises(IntegrityError, match="5000 bytes, its manifest says 1000|larger than the 1000"):
        store.get_bytes("objects/big", max_size=1000)
    assert store.get_bytes("objects/big", max_size=5000) == b"x" * 5000


def test_an_s3_endpoint_that_understates_a_size_gets_no_more_bytes_written(new_bucket, moto, make_ckpt, tmp_path,
                                                                          caplog):
    """A server whose HEAD says 10 bytes and whose GET sends 1 MiB: the download stops at byte 10
    (the writer refuses more), before the file is ever compared with the manifest."""
    from spotguard.storage import StoreOptions, open_store
    from storage_proxy import Proxy

    class Understating(Proxy):
        def rewrite(self, method, path, headers):
            return [(k, "10" if method == "HEAD" and k.lower() == "content-length" else v) for k, v in headers]

    direct = new_bucket("s3")
    big = os.urandom(1 << 20)
    Durable(direct).upload(make_ckpt(tmp_path / "local", 1, {"w.bin": big}), "job")
    body = json.loads(direct.get_bytes(manifest_key("job", 1)))
    body["files"]["w.bin"]["size"] = 10
    direct.put_bytes(manifest_key("job", 1), json.dumps(body).encode())
    with Understating(moto.url) as proxy, caplog.at_level(logging.WARNING):
        store = open_store(f"s3://{direct.bucket}/pre", StoreOptions(endpoint_url=proxy.url, max_attempts=1))
        with pytest.raises(IntegrityError, match="no sound checkpoint"):
            Durable(store).restore("job", tmp_path / "dest")
    assert "larger than the 10 bytes expected" in caplog.text, caplog.text
