"""The durable commit protocol on every backend: upload, dedup, restore, fallback, torn uploads, prune."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from spotguard.storage import Durable, IntegrityError, ManifestError, NotFound, TransientError
from spotguard.storage.durable import manifest_key, object_key

from storage_proxy import Proxy


def files_of(seed: int, n: int = 4, size: int = 64 * 1024) -> dict[str, bytes]:
    return {f"rank-0/t{i}.bin": bytes([seed % 251]) * 16 + os.urandom(size) for i in range(n)}


def local_tree(ckpt: Path) -> dict[str, object]:
    """Every file's bytes; the manifest parsed (restore rewrites it with the same content)."""
    tree: dict[str, object] = {str(p.relative_to(ckpt)): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    tree["manifest.json"] = json.loads(tree["manifest.json"])
    return tree


def test_upload_list_latest_and_restore_on_a_fresh_node(store, make_ckpt, tmp_path):
    durable = Durable(store)
    first = make_ckpt(tmp_path / "node-a", 100, files_of(1))
    second = make_ckpt(tmp_path / "node-a", 200, files_of(2) | {"extra/nested/x.json": b"{}"})
    info = durable.upload(first, "job-1")
    durable.upload(second, "job-1")
    assert (info.step, info.files, info.objects_uploaded) == (100, 4, 4)
    assert durable.list("job-1") == [100, 200] and durable.latest("job-1") == 200
    assert durable.list("other-job") == [] and durable.latest("other-job") is None

    restored = durable.restore("job-1", tmp_path / "node-b")  # node-a is gone: a fresh node
    assert restored == tmp_path / "node-b" / "step-0000000200"
    assert local_tree(restored) == local_tree(second)
    assert (tmp_path / "node-b/latest").read_text() == "step-0000000200\n"
    assert restored.stat().st_mode & 0o077 == 0
    assert [p.name for p in (tmp_path / "node-b").iterdir() if p.name.startswith(".")] == []
    assert durable.verify("job-1", 100) == [] and durable.verify("job-1", 200, deep=False) == []


def test_unchanged_content_is_not_uploaded_again(backend, new_bucket, make_ckpt, tmp_path, request):
    """Bytes on the wire follow bytes changed (counted at an HTTP proxy for the cloud backends)."""
    upstream = {"s3": "moto", "gcs": "fake_gcs", "azure": "azurite"}.get(backend)
    if upstream is None:
        return _dedup_counts(Durable(new_bucket("file")), make_ckpt, tmp_path, None)
    with Proxy(request.getfixturevalue(upstream).url) as proxy:
        _dedup_counts(Durable(new_bucket(backend, endpoint=proxy.url)), make_ckpt, tmp_path, proxy)


def _dedup_counts(durable: Durable, make_ckpt, tmp_path: Path, proxy: Proxy | None) -> None:
    frozen = files_of(7, n=9)
    durable.upload(make_ckpt(tmp_path / "c", 1, frozen | {"head.bin": os.urandom(50_000)}), "ft")
    if proxy:
        proxy.reset()
    again = durable.upload(make_ckpt(tmp_path / "c", 2, frozen | {"head.bin": os.urandom(50_000)}), "ft")
    assert (again.objects_uploaded, again.objects_skipped, again.bytes_uploaded) == (1, 9, 50_000)
    assert again.bytes_total == 9 * (64 * 1024 + 16) + 50_000
    if proxy:
        on_wire = proxy.bytes_sent_to("")
        assert 50_000 <= on_wire < 50_000 + 8192, on_wire  # + pending note, manifest, pointer
    same = durable.upload(make_ckpt(tmp_path / "c", 3, frozen), "ft")
    assert (same.objects_uploaded, same.bytes_uploaded) == (0, 0)


def test_a_corrupt_object_makes_restore_fall_back_and_say_so(store, make_ckpt, tmp_path, caplog):
    durable = Durable(store)
    durable.upload(make_ckpt(tmp_path / "a", 100, files_of(1)), "j")
    newer = files_of(2)
    durable.upload(make_ckpt(tmp_path / "a", 200, newer), "j")
    victim = object_key(json.loads(store.get_bytes(manifest_key("j", 200)))["files"]["rank-0/t2.bin"]["sha256"])
    good = bytearray(store.get_bytes(victim))
    good[100] ^= 0xFF
    store.put_bytes(victim, bytes(good))  # bit rot in the bucket

    with caplog.at_level(logging.WARNING, logger="spotguard.storage"):
        restored = durable.restore("j", tmp_path / "fresh")
    assert restored.name == "step-0000000100"
    assert "skipping step-0000000200" in caplog.text and "corrupt" in caplog.text
    assert (tmp_path / "fresh/latest").read_text() == "step-0000000100\n"
    assert not (tmp_path / "fresh/step-0000000200").exists()
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["latest", "step-0000000100"]
    assert any("rank-0/t2.bin" in p and "corrupt" in p for p in durable.verify("j", 200))
    with pytest.raises(IntegrityError, match="step-0000000200"):
        durable.restore("j", tmp_path / "explicit", step=200)


class _CrashBefore:
    """A real store that 'crashes' (raises) when the upload reaches a key containing ``marker``."""

    def __init__(self, store, marker: str) -> None:
        self._store, self._marker = store, marker

    def put_bytes(self, key: str, data: bytes) -> None:
        if self._marker in key:
            raise TransientError(f"simulated crash before {key}")
        self._store.put_bytes(key, data)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_torn_upload_is_invisible_to_readers(store, make_ckpt, tmp_path):
    durable = Durable(store)
    done = make_ckpt(tmp_path / "a", 100, files_of(1))
    durable.upload(done, "j")
    torn = make_ckpt(tmp_path / "a", 200, files_of(2))
    with pytest.raises(TransientError):
        Durable(_CrashBefore(store, "/manifests/"), attempts=1).upload(torn, "j")
    assert sum(1 for _ in store.list("objects/")) == 8  # its objects did land...
    assert durable.list("j") == [100] and durable.latest("j") == 100  # ...but no reader sees them
    assert local_tree(durable.restore("j", tmp_path / "b")) == local_tree(done)

    assert durable.prune("j", keep=1).objects_deleted == 0  # the fresh pending note protects them
    report = durable.prune("j", keep=1, pending_ttl=-1)  # an abandoned upload: collected
    assert (report.objects_deleted, report.pending_deleted) == (4, 1)
    assert durable.verify("j", 100) == []
    retried = durable.upload(torn, "j")
    assert retried.objects_uploaded == 4 and durable.latest("j") == 200


def test_pointer_written_last_and_never_moves_backwards(store, make_ckpt, tmp_path):
    durable = Durable(store)
    new, old = make_ckpt(tmp_path / "a", 300, files_of(3)), make_ckpt(tmp_path / "b", 200, files_of(2))
    with pytest.raises(TransientError):
        Durable(_CrashBefore(store, "/latest"), attempts=1).upload(new, "j")
    assert durable.list("j") == [300]  # manifest landed, pointer did not: the newest manifest wins
    assert durable.latest("j") == 300
    durable.upload(new, "j")
    durable.upload(old, "j")  # an older checkpoint finishing late
    assert store.get_bytes("jobs/j/latest") == b"step-0000000300\n"
    assert durable.restore("j", tmp_path / "c").name == "step-0000000300"


def test_prune_keeps_the_newest_and_objects_other_jobs_use(store, make_ckpt, tmp_path):
    durable = Durable(store)
    shared = {"frozen.bin": os.urandom(30_000)}
    for step in (1, 2, 3, 4):
        durable.upload(make_ckpt(tmp_path / "a", step, shared | {"head.bin": os.urandom(1000 + step)}), "a")
    first_head = json.loads(store.get_bytes(manifest_key("a", 1)))["files"]["head.bin"]["sha256"]
    durable.upload(make_ckpt(tmp_path / "b", 9, {"copy.bin": (tmp_path / "a/step-0000000001/head.bin").read_bytes()}), "b")

    report = durable.prune("a", keep=2)
    assert report.manifests_deleted == [1, 2] and durable.list("a") == [3, 4]
    assert report.objects_deleted == 1  # step 2's head; step 1's head is job b's copy.bin
    assert store.exists(object_key(first_head))
    assert durable.verify("a", 3) == [] and durable.verify("a", 4) == [] and durable.verify("b", 9) == []
    assert durable.prune("a", keep=2).objects_deleted == 0


@pytest.mark.parametrize("backend", ["file", "s3"])  # backend-independent logic
def test_restore_skips_corrupt_and_unsafe_manifests(store, make_ckpt, tmp_path, caplog):
    durable = Durable(store)
    durable.upload(make_ckpt(tmp_path / "a", 1, files_of(1)), "j")
    durable.upload(make_ckpt(tmp_path / "a", 2, files_of(2)), "j")
    durable.upload(make_ckpt(tmp_path / "a", 3, files_of(3)), "j")
    store.put_bytes(manifest_key("j", 3), b'{"format": "spotguard-checkpoint", "ste')
    evil = json.loads(store.get_bytes(manifest_key("j", 2)))
    evil["files"]["../../escaped"] = evil["files"].pop("rank-0/t0.bin")
    store.put_bytes(manifest_key("j", 2), json.dumps(evil).encode())

    with caplog.at_level(logging.WARNING):
        assert durable.restore("j", tmp_path / "dest").name == "step-0000000001"
    assert "step-0000000003" in caplog.text and "unsafe file path" in caplog.text
    assert not (tmp_path / "escaped").exists()
    with pytest.raises(ManifestError):
        durable.manifest("j", 2)
    assert durable.prune("j", keep=1).objects_deleted == 0  # unknown references: collect nothing
    assert len(list(store.list("objects/"))) == 12


@pytest.mark.parametrize("backend", ["file", "s3"])  # backend-independent logic
def test_upload_refuses_files_changed_after_commit(store, make_ckpt, tmp_path):
    ckpt = make_ckpt(tmp_path / "a", 5, files_of(5))
    (ckpt / "rank-0/t1.bin").write_bytes(b"changed after the manifest was written")
    with pytest.raises(IntegrityError, match="changed after commit"):
        Durable(store).upload(ckpt, "j")
    assert Durable(store).list("j") == []


@pytest.mark.parametrize("backend", ["file", "s3"])  # backend-independent logic
def test_restore_replaces_a_stale_local_copy_and_reports_absent_jobs(store, make_ckpt, tmp_path):
    durable = Durable(store)
    durable.upload(make_ckpt(tmp_path / "a", 7, files_of(7)), "j")
    stale = tmp_path / "dest/step-0000000007"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("half-written by a crashed process")
    assert local_tree(durable.restore("j", tmp_path / "dest")) == local_tree(tmp_path / "a/step-0000000007")
    with pytest.raises(NotFound, match="no durable checkpoint"):
        durable.restore("nobody", tmp_path / "dest2")


@pytest.mark.parametrize("job", ["", "../x", "a/b", ".hidden", "x" * 200])
def test_job_ids_cannot_escape_their_prefix(job, tmp_path):
    from spotguard.storage import open_store

    with pytest.raises(ValueError, match="invalid job id"):
        Durable(open_store(f"file://{tmp_path}")).list(job)


def test_progress_reports_bytes_done_up_to_the_total(make_ckpt, tmp_path):
    from spotguard.storage import open_store

    seen: list[tuple[int, int]] = []
    info = Durable(open_store(f"file://{tmp_path}/b")).upload(
        make_ckpt(tmp_path / "a", 1, files_of(1)), "j", progress=lambda done, total: seen.append((done, total)))
    assert len(seen) == 4 and seen[-1] == (info.bytes_total, info.bytes_total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
