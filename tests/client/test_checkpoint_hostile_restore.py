"""A hostile checkpoint in a bucket, end to end: restore from the store, then ``load_latest``
(issue 8 §3). The bucket's newest checkpoint is self-consistent as far as the store can tell (every
object's size and sha256 match its manifest), but its tensor index disagrees with the bytes, or its
DCP ``.metadata`` is a pickle whose ``__reduce__`` would run a command. Restore writes only under
the destination; loading refuses the hostile step, runs nothing and loads the previous good one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from spotguard.checkpoint import Checkpointer
from spotguard.storage.durable import Durable, manifest_key, object_key
from spotguard.storage.file import FileStore
from test_checkpoint_sharded import SAVES, TORCHRUN, _Evil, run_torchrun, runs  # noqa: F401 (fixture)

JOB = "job"


def tamper(durable: Durable, step: int, rel: str, data: bytes) -> None:
    """Replace ``rel`` of ``step`` in the bucket and fix its manifest entry, as an attacker with write
    access would, so that only the loader's own checks stand in the way."""
    sha = hashlib.sha256(data).hexdigest()
    durable.store.put_bytes(object_key(sha), data)
    key = manifest_key(JOB, step)
    manifest = json.loads(durable.store.get_bytes(key))
    manifest["files"][rel] = {"size": len(data), "sha256": sha}
    durable.store.put_bytes(key, json.dumps(manifest).encode())


def restore_all(durable: Durable, steps, dest: Path) -> Path:
    """Restore every step, oldest first (``latest`` names the newest), into ``dest/root``."""
    for step in steps:
        durable.restore(JOB, dest / "root", step)
    return dest / "root"


def assert_only_under(dest: Path) -> None:
    assert sorted(p.name for p in dest.iterdir()) == ["root"]


# ---------------------------------------------------------------- tensor index vs bytes


def with_index(edit):
    def rewrite(tree: dict) -> dict:
        big = next(e for e in tree["tensors"] if e["nbytes"] == 4 << 19)
        edit(big)
        return tree
    return rewrite


LIES = {
    "dtype": with_index(lambda e: e.update(dtype="float64")),                    # 8-byte items, same nbytes
    "shape": with_index(lambda e: e.update(shape=[1 << 20])),                    # twice the elements
    "past its file": with_index(lambda e: e.update(shape=[1 << 20], nbytes=8 << 19)),  # beyond the file
    "negative offset": with_index(lambda e: e.update(offset=-64)),
    "unknown dtype": with_index(lambda e: e.update(dtype="__import__('os')")),
}


@pytest.mark.parametrize("lie", LIES)
def test_a_tensor_index_that_disagrees_with_its_bytes_falls_back_to_the_previous_step(tmp_path, caplog, lie):
    with Checkpointer(tmp_path / "local") as ck:
        for step in (1, 2):
            ck.save(step, {"big": torch.full((1 << 19,), float(step)), "small": torch.full((3,), float(step))})
    durable = Durable(FileStore(tmp_path / "bucket"))
    for step in (1, 2):
        durable.upload(tmp_path / "local" / f"step-{step:010d}", JOB)
    tree = json.loads((tmp_path / "local" / "step-0000000002" / "rank-0" / "tree.json").read_text())
    tamper(durable, 2, "rank-0/tree.json", json.dumps(LIES[lie](tree)).encode())

    root = restore_all(durable, (1, 2), tmp_path / "dest")
    assert (root / "latest").read_text().strip() == "step-0000000002"
    state = {"big": torch.zeros(1 << 19), "small": torch.zeros(3)}
    with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint"):
        info = Checkpointer(root).load_latest(state)
    assert info.step == 1 and bool((state["big"] == 1).all()) and bool((state["small"] == 1).all())
    assert any("step-0000000002" in r.getMessage() for r in caplog.records)
    assert_only_under(tmp_path / "dest")


# ---------------------------------------------------------------- DCP .metadata pickle


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_a_metadata_pickle_from_the_bucket_never_runs_and_the_previous_step_loads(runs, tmp_path):
    base, _, _ = runs
    marker = tmp_path / "pwned"
    durable = Durable(FileStore(tmp_path / "bucket"))
    for step in SAVES:
        durable.upload(base / "ckpt" / f"step-{step:010d}", JOB)
    evil = pickle.dumps(_Evil(marker))
    tamper(durable, SAVES[-1], "rank-0/dcp/.metadata", evil)

    root = restore_all(durable, SAVES, tmp_path / "dest")
    assert (root / f"step-{SAVES[-1]:010d}" / "rank-0" / "dcp" / ".metadata").read_bytes() == evil
    assert_only_under(tmp_path / "dest")
    resumed = run_torchrun(root, tmp_path / "out", "resume")
    assert not marker.exists()
    assert [r["loaded"] for r in resumed] == [SAVES[0]] * 2
    assert_only_under(tmp_path / "dest")
