"""A file changed after its checkpoint was committed (issue 12.10) is refused by every backend: the
upload raises IntegrityError, nothing is stored under the manifest's content address, the checkpoint
is not durable, and a later checkpoint with the true bytes uploads and verifies."""

from __future__ import annotations

import os

import pytest

from spotguard.storage import Durable, IntegrityError
from spotguard.storage._local import read_manifest
from spotguard.storage.durable import object_key

BIG = 2 * 1024 * 1024 + 12345  # > part_size of the test buckets: multipart / resumable / blocks


@pytest.mark.parametrize("change", ["rewritten", "truncated"])
def test_changed_file_is_refused_then_true_bytes_upload(store, make_ckpt, tmp_path, change):
    durable = Durable(store, attempts=1)
    ckpt = make_ckpt(tmp_path / "local", 1, {"w.bin": os.urandom(BIG), "small.bin": os.urandom(100)})
    declared = read_manifest(ckpt)["files"]
    for rel in declared:
        path = ckpt / rel
        path.write_bytes(os.urandom(path.stat().st_size) if change == "rewritten" else path.read_bytes()[:-1])
    with pytest.raises(IntegrityError, match="changed after commit"):
        durable.upload(ckpt, "job")
    assert not any(store.exists(object_key(meta["sha256"])) for meta in declared.values())
    assert durable.list("job") == [] and durable.latest("job") is None
    truth = {rel: (ckpt / rel).read_bytes() for rel in declared}
    good = make_ckpt(tmp_path / "local", 2, truth)
    assert durable.upload(good, "job").objects_uploaded == 2
    assert durable.verify("job", 2) == []
    restored = durable.restore("job", tmp_path / "fresh")
    assert all((restored / rel).read_bytes() == data for rel, data in truth.items())
