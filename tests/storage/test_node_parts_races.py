"""Issue 28 items 3 and 7: node parts of one job from several nodes and incarnations, racing.

Real stores (``file://``; the race is in the order of requests, not in a backend), a node's
:class:`Durable` per node; the interleavings are forced at the exact request where they hurt.
"""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

from spotguard.storage import Durable, _parts
from spotguard.storage._keys import object_key
from spotguard.storage.durable import GC_GRACE_SECONDS, manifest_key
from spotguard.storage.file import FileStore

from test_upload_long_run import node_ckpt

X = b"x" * 5000  # a body step 10 holds and step 30 holds again (content addressed: one object)


class ListHook(FileStore):
    """Runs ``hook`` once, right after the first listing of ``jobs/`` (a prune's reference read)."""

    hook = None

    def list(self, prefix: str):
        keys = list(super().list(prefix))
        if prefix == "jobs/" and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return keys


@pytest.mark.parametrize("grace", [GC_GRACE_SECONDS, 0.0])
def test_retention_on_one_node_never_leaves_a_global_step_without_its_objects(tmp_path, grace):
    """Node 1 completes step 20 and prunes (keep=1): the object X only step 10 named is garbage.
    Right after its reference read, node 0 uploads its part of step 30, finds X present and skips
    it; then node 1's delete would land, and node 1's part completes step 30. Before, step 30 became
    global naming a missing X. Now the prune reads the notes and parts again right before its
    delete (and the daemon's grace period spares X anyway): X stays, step 30 is global and restores."""
    bucket = tmp_path / "bucket"
    node0, node1 = Durable(FileStore(bucket)), Durable(ListHook(bucket))
    for step, body in ((10, X), (20, b"twenty" * 100)):
        node0.upload(node_ckpt(tmp_path / "n0", step, 0, {"w.bin": body}), "job")
        node1.upload(node_ckpt(tmp_path / "n1", step, 1, {"w.bin": bytes([step]) * 100}), "job")
    late = node_ckpt(tmp_path / "n0", 30, 0, {"w.bin": X})
    node1.store.hook = lambda: node0.upload(late, "job")
    node1.prune("job", keep=1, grace=grace)
    node1.upload(node_ckpt(tmp_path / "n1", 30, 1, {"w.bin": b"thirty" * 100}), "job")  # completes the set

    assert node0.store.exists(object_key(hashlib.sha256(X).hexdigest()))
    checker = Durable(FileStore(bucket))
    assert checker.latest("job") == 30 and checker.verify("job", 30) == []
    checker.restore("job", tmp_path / "fresh")


def test_an_object_deleted_after_a_part_reused_it_is_sent_again_before_the_step_is_global(tmp_path, caplog):
    """The window no re-read closes: another node's delete of X lands after node 0 found X present
    and after its part is in the store. Node 0 checks its part's objects once the part is in the
    store, sends X again and says so; node 1 then completes a step that restores."""
    bucket = tmp_path / "bucket"
    x_key = object_key(hashlib.sha256(X).hexdigest())

    class DeleteAfterPart(FileStore):
        def put_bytes(self, key: str, data: bytes) -> None:
            super().put_bytes(key, data)
            if "/parts/step-0000000030/" in key:
                self.delete([x_key])  # as node 1's prune, landing just then

    node0, node1 = Durable(DeleteAfterPart(bucket)), Durable(FileStore(bucket))
    node0.upload(node_ckpt(tmp_path / "n0", 10, 0, {"w.bin": X}), "job")
    node1.upload(node_ckpt(tmp_path / "n1", 10, 1, {"w.bin": b"ten" * 100}), "job")
    info = node0.upload(node_ckpt(tmp_path / "n0", 30, 0, {"w.bin": X}), "job")
    assert info.objects_uploaded == 1 and "were gone from the store once its part was written" in caplog.text
    node1.upload(node_ckpt(tmp_path / "n1", 30, 1, {"w.bin": b"thirty" * 100}), "job")
    checker = Durable(FileStore(bucket))
    assert checker.latest("job") == 30 and checker.verify("job", 30) == []


def test_objects_named_by_a_part_of_a_step_not_yet_global_are_never_collected(tmp_path):
    """Node 0's part of step 30 is in the store, node 1's is not yet: a prune on node 0 (keep=1)
    keeps every object that part names, whatever the grace."""
    durable = Durable(FileStore(tmp_path / "bucket"))
    for k in (0, 1):
        durable.upload(node_ckpt(tmp_path / f"n{k}", 20, k, {"w.bin": bytes([k]) * 100}), "job")
    durable.upload(node_ckpt(tmp_path / "n0", 30, 0, {"new.bin": b"n" * 300}), "job")
    durable.prune("job", keep=1, grace=0.0)
    durable.upload(node_ckpt(tmp_path / "n1", 30, 1, {"w.bin": b"m" * 300}), "job")
    assert durable.latest("job") == 30 and durable.verify("job", 30) == []


def test_concurrent_completions_write_the_global_manifest_once(tmp_path):
    """Items 7 and 9: four daemons find the set complete at once: the global manifest is written
    once (``put_bytes_if_absent``), the others find it there with their own bytes, and nothing is
    written twice."""
    writes: list[bytes] = []
    tried: list[bytes] = []
    checked = threading.Barrier(4, timeout=30)

    class Recording(FileStore):
        def exists(self, key: str) -> bool:
            if key == manifest_key("job", 10) and not hasattr(local, "checked"):
                local.checked = True
                checked.wait()  # all four look before any writes: none takes the "already global" path
            return super().exists(key)

        def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
            wrote = super().put_bytes_if_absent(key, data)
            if key == manifest_key("job", 10):
                tried.append(data)
                if wrote:
                    writes.append(data)
            return wrote

        def put_bytes(self, key: str, data: bytes) -> None:
            if key == manifest_key("job", 10):
                writes.append(data)
            super().put_bytes(key, data)

    bucket = tmp_path / "bucket"
    seed = Durable(FileStore(bucket))
    for k in (0, 1):  # the parts land; nobody completes the set (each sees only its own part)
        ckpt = node_ckpt(tmp_path / f"n{k}", 10, k, {"w.bin": bytes([k]) * 1000})
        seed.store.put_bytes(f"objects/sha256/{hashlib.sha256(bytes([k]) * 1000).hexdigest()}",
                             bytes([k]) * 1000)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        part = _parts.uploaded_part(manifest, {"version": 1, "name": ckpt.name, "objects": "objects/sha256/",
                                               "uploaded": 1000.0 + k})
        seed.store.put_bytes(_parts.part_key("job", 10, k, _parts.token(part)), json.dumps(part).encode())
    local = threading.local()

    def complete() -> None:
        Durable(Recording(bucket)).complete("job", 10)

    threads = [threading.Thread(target=complete) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(writes) == 1 and len(tried) == 4 and len(set(tried)) == 1, (len(writes), len(tried))
    assert Durable(FileStore(bucket)).latest("job") == 10


def test_a_relaunchs_global_step_replaces_an_abandoned_runs_of_the_same_number(tmp_path):
    """A step N made global by a run the relaunch abandoned (it resumed from N-1) is replaced by
    the relaunch's own step N once its set is complete: a write-once never keeps the old one."""
    durable = Durable(FileStore(tmp_path / "bucket"))
    for digest, body in (("o", b"old"), ("n", b"new")):
        for k in (0, 1):
            durable.upload(node_ckpt(tmp_path / f"{digest}{k}", 20, k, {"w.bin": body * 100 + bytes([k])},
                                     digest=digest), "job")
        assert durable.manifest("job", 20)["digest"] == digest * 64
    restored = durable.restore("job", tmp_path / "fresh")
    assert (restored / "rank-0" / "w.bin").read_bytes() == b"new" * 100 + b"\x00"


def test_an_old_incarnation_still_uploading_never_mixes_into_the_relaunch(tmp_path):
    """Item 7: node 0 of the previous launch is still uploading its step 20 while the relaunch,
    resumed from step 10 and trained differently, writes its own step 20 on both nodes. The old
    part never joins the new set (parts are assembled per incarnation): step 20 is global only with
    the relaunch's parts, and the old upload, landing last, completes nothing and leaves the global
    step alone."""
    durable = Durable(FileStore(tmp_path / "bucket"))
    durable.replicated_wait = 0.5  # node 1 of the relaunch uploads before its node 0
    for k in (0, 1):
        durable.upload(node_ckpt(tmp_path / f"old{k}", 10, k, {"w.bin": bytes([k]) * 100}), "job")
    old = node_ckpt(tmp_path / "old0", 20, 0, {"w.bin": b"old" * 100}, digest="o")
    new = [node_ckpt(tmp_path / f"new{k}", 20, k, {"w.bin": b"new" * 100 + bytes([k])}, digest="n")
           for k in (0, 1)]
    durable.upload(old, "job")  # the old node's part lands first
    # the relaunch's node 1: its part is in, but its incarnation's set lacks node 0: nothing global
    assert durable.upload(new[1], "job").complete is False
    assert durable.latest("job") == 10
    durable.upload(new[0], "job")  # beside the old node's part (another token): the relaunch's set, global
    assert durable.latest("job") == 20
    assert durable.manifest("job", 20)["digest"] == "n" * 64
    assert durable.upload(old, "job").complete is False  # the old node's upload, retried, lands last
    assert durable.latest("job") == 20 and durable.manifest("job", 20)["digest"] == "n" * 64
    restored = Durable(FileStore(tmp_path / "bucket")).restore("job", tmp_path / "fresh")
    assert (restored / "rank-0" / "w.bin").read_bytes() == b"new" * 100 + b"\x00"
