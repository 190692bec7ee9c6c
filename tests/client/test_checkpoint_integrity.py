"""Damaged checkpoints are detected before anything is restored, and the previous one is used."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import zlib
from pathlib import Path

import pytest
import torch

from spotguard.checkpoint import Checkpointer, CheckpointCorruptError


def two_checkpoints(root: Path) -> Path:
    """Steps 1 and 2 with distinct values; returns step 2's directory."""
    with Checkpointer(root) as ck:
        for step in (1, 2):
            ck.save(step, {"big": torch.full((1 << 19,), float(step)), "small": torch.full((3,), float(step)),
                           "extras": {"step": step}})
    return root / "step-0000000002"


def load(root: Path, **kwargs) -> tuple[int | None, dict]:
    state = {"big": torch.zeros(1 << 19), "small": torch.zeros(3), "extras": {}}
    info = Checkpointer(root, **kwargs).load_latest(state)
    return (info.step if info else None), state


def big_file(ckpt: Path) -> Path:
    return next((ckpt / "rank-0" / "tensors").iterdir())


def rewrite_manifest(ckpt: Path, edit) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    edit(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def assert_falls_back(root: Path, caplog, reason: str) -> None:
    with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint"):
        step, state = load(root)
    assert step == 1 and state["big"][0] == 1 and state["small"][0] == 1 and state["extras"] == {"step": 1}
    assert any("step-0000000002" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_truncated_file_falls_back(tmp_path, caplog):
    path = big_file(two_checkpoints(tmp_path))
    os.truncate(path, path.stat().st_size - 1)
    assert_falls_back(tmp_path, caplog, "bytes, manifest says")


def flip_byte(path: Path, at: int = 12345) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


def test_flipped_byte_falls_back_unless_verify_is_off(tmp_path, caplog):
    ckpt = two_checkpoints(tmp_path)
    meta = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert all(len(m["xxh3"]) == -(-m["size"] // m["xxh3_chunk"]) and len(m["sha256"]) == 64 for m in meta.values())
    flip_byte(big_file(ckpt))
    assert_falls_back(tmp_path, caplog, "xxh3 of bytes 0+ mismatch in rank-0/tensors/")
    assert load(tmp_path, verify=False)[0] == 2  # the flag really skips hashing


def test_a_checkpoint_with_chunk_crc32s_is_checked_by_them(tmp_path, caplog):
    """Checkpoints written just before XXH3 list a zlib crc32 per chunk instead: they still load,
    checked by those, and a flipped byte in them is caught."""
    ckpt = two_checkpoints(tmp_path)

    def to_crc32(m, root):
        for rel, f in m["files"].items():
            data, chunk = (root / rel).read_bytes(), f.pop("xxh3_chunk")
            f.pop("xxh3")
            f["crc32"], f["crc32_chunk"] = [zlib.crc32(data[i : i + chunk]) for i in range(0, len(data), chunk)], chunk
    rewrite_manifest(ckpt, lambda m: to_crc32(m, ckpt))
    rewrite_manifest(tmp_path / "step-0000000001", lambda m: to_crc32(m, tmp_path / "step-0000000001"))
    assert load(tmp_path)[0] == 2
    flip_byte(big_file(ckpt))
    assert_falls_back(tmp_path, caplog, "crc32 of bytes 0+ mismatch in rank-0/tensors/")


def test_a_checkpoint_without_chunk_checks_is_checked_by_its_sha256(tmp_path, caplog):
    """Checkpoints written before the per-chunk checks list only a sha256 per file: they still load,
    and a flipped byte in them is still caught."""
    ckpt = two_checkpoints(tmp_path)
    strip = lambda m: [f.pop(k) for f in m["files"].values() for k in ("xxh3", "xxh3_chunk")]  # noqa: E731
    rewrite_manifest(ckpt, strip)
    rewrite_manifest(tmp_path / "step-0000000001", strip)
    assert load(tmp_path)[0] == 2
    flip_byte(big_file(ckpt))
    assert_falls_back(tmp_path, caplog, "sha256 mismatch in rank-0/tensors/")


@pytest.mark.parametrize("victim", ["manifest.json", "rank-0/tree.json", "rank-0/small.bin"])
def test_missing_file_falls_back(tmp_path, caplog, victim):
    (two_checkpoints(tmp_path) / victim).unlink()
    assert_falls_back(tmp_path, caplog, "manifest" if victim == "manifest.json" else "missing")


def test_garbage_tree_falls_back(tmp_path, caplog):
    ckpt = two_checkpoints(tmp_path)
    tree = b'{"entries": [["big", "tensor", {"exec": "os.system"}]], "tensors": []}'
    (ckpt / "rank-0/tree.json").write_bytes(tree)
    rewrite_manifest(ckpt, lambda m: m["files"].update(
        {"rank-0/tree.json": {"size": len(tree), "sha256": hashlib.sha256(tree).hexdigest()}}))
    assert_falls_back(tmp_path, caplog, "unknown tree tag")


class _Boom:
    def __reduce__(self):
        return (os.mkdir, (os.environ["SPOTGUARD_TEST_PWNED"],))


def test_manifest_pointing_at_a_pickle_is_refused_never_unpickled(tmp_path, caplog, monkeypatch):
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("SPOTGUARD_TEST_PWNED", str(pwned))
    ckpt = two_checkpoints(tmp_path / "root")
    payload = pickle.dumps({"big": _Boom()})
    for name in ("rank-0/model.pt", "rank-0/state.pkl"):
        (ckpt / name).write_bytes(payload)
    meta = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    rewrite_manifest(ckpt, lambda m: m["files"].update({"rank-0/model.pt": meta, "rank-0/state.pkl": meta}))
    assert_falls_back(tmp_path / "root", caplog, "refusing file")
    assert not pwned.exists()


def test_pickle_disguised_as_bin_is_read_as_bytes_only(tmp_path, caplog, monkeypatch):
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("SPOTGUARD_TEST_PWNED", str(pwned))
    ckpt = two_checkpoints(tmp_path / "root")
    payload = pickle.dumps(_Boom())
    (ckpt / "rank-0/small.bin").write_bytes(payload)
    meta = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    rewrite_manifest(ckpt, lambda m: m["files"].update({"rank-0/small.bin": meta}))
    load(tmp_path / "root")  # raw bytes reinterpreted (or refused): never executed
    assert not pwned.exists()


@pytest.mark.parametrize("relpath", ["../outside.bin", "/etc/hostname.bin", "rank-0/link.bin"])
def test_paths_outside_the_checkpoint_are_refused(tmp_path, caplog, relpath):
    ckpt = two_checkpoints(tmp_path / "root")
    (tmp_path / "root" / "outside.bin").write_bytes(b"x")
    os.symlink(tmp_path / "root" / "outside.bin", ckpt / "rank-0/link.bin")
    rewrite_manifest(ckpt, lambda m: m["files"].update({relpath: {"size": 1, "sha256": "0" * 64}}))
    assert_falls_back(tmp_path / "root", caplog, "")


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    ckpt = two_checkpoints(tmp_path)
    (ckpt / "manifest.json").unlink()
    (tmp_path / "step-0000000001" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointCorruptError, match="none of the 2 checkpoints"):
        load(tmp_path)
    assert Checkpointer(tmp_path).latest() is None


def test_latest_skips_incomplete_without_hashing(tmp_path):
    ckpt = two_checkpoints(tmp_path)
    big_file(ckpt).unlink()
    assert Checkpointer(tmp_path).latest().step == 1
