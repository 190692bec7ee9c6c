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

from spotguard.storage import Durable
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
