"""restore_newer on every backend: restore only when the store is ahead of the local root."""

from __future__ import annotations

import os
import time

import pytest
from spotguard.storage import Durable, StoreOptions, restore_newer
from spotguard.storage.fresh_node import RestoreFailed, local_latest_step, store_from_env

from storage_proxy import Proxy


def test_restores_only_when_the_store_is_ahead(store, tmp_path, make_ckpt):
    durable = Durable(store)
    source = tmp_path / "old-node"
    durable.upload(make_ckpt(source, 5, {"w.bin": b"w" * 100}), "default")
    durable.upload(make_ckpt(source, 9, {"w.bin": b"v" * 100}), "default")
    node = tmp_path / "new-node"
    url = _url(store)
    restored = restore_newer(node, "default", url, _options(store))
    assert restored is not None and restored.name == "step-0000000009"
    assert local_latest_step(node) == 9 and (restored / "w.bin").read_bytes() == b"v" * 100
    assert restore_newer(node, "default", url, _options(store)) is None  # as new as the store now
    make_ckpt(node, 12, {"w.bin": b"u"})
    assert restore_newer(node, "default", url, _options(store)) is None  # local is ahead


def test_nothing_in_the_store_restores_nothing(store, tmp_path):
    assert restore_newer(tmp_path / "node", "job", _url(store), _options(store)) is None
    assert not (tmp_path / "node").exists()


def test_store_from_env_reads_the_daemon_variables():
    url, options = store_from_env({"SPOTGUARD_STORAGE__URL": "s3://b/p",
                                   "SPOTGUARD_STORAGE__ENDPOINT_URL": "http://127.0.0.1:9"})
    assert url == "s3://b/p" and options.endpoint_url == "http://127.0.0.1:9"
    assert store_from_env({}) == (None, options.__class__())


def _url(store) -> str:
    return store.url


def _options(store):
    return getattr(store, "options", None)


class GetFaults(Proxy):
    """Breaks only GET requests (what a fresh node sends), at the seeded rate."""

    def pick_fault(self, method: str, path: str) -> str | None:
        return super().pick_fault(method, path) if method == "GET" else None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_fresh_node_rides_out_transient_read_faults(moto, new_bucket, make_ckpt, tmp_path, seed):
    """Issue 21.10: resets, truncated bodies and 503s in front of S3 (the SDK retrying nothing):
    each of three restores gets the store's step 4. Before, one fault on ``latest``, a manifest or
    an object ended the restore ("going on with local checkpoints") or skipped step 4 as damaged."""
    direct = new_bucket("s3")
    files = {"w.bin": os.urandom(20_000), "b.bin": os.urandom(3_000)}
    for step in (2, 4):
        Durable(direct).upload(make_ckpt(tmp_path / "old", step, {**files, "s.bin": bytes([step]) * 100}), "job")
    with GetFaults(moto.url, seed=seed, fault_rate=0.5, faults=("reset", "reset_after", "503", "truncate"),
                   max_faults=12) as proxy:
        options = StoreOptions(endpoint_url=proxy.url, max_attempts=1, retry_seconds=60)
        restored = restore_newer(tmp_path / "node", "job", f"s3://{direct.bucket}/pre", options)
        assert proxy.injected, "no fault was injected: the test proves nothing"
    assert restored is not None and restored.name == "step-0000000004"
    assert all((restored / rel).read_bytes() == data for rel, data in files.items())


def test_a_store_that_keeps_failing_is_a_restore_failure_naming_both_steps(moto, new_bucket, make_ckpt, tmp_path):
    """The store's step 4 cannot be read within the retry time: RestoreFailed says so, with the
    store's step and the local one, after retrying (not at the first fault)."""
    direct = new_bucket("s3")
    Durable(direct).upload(make_ckpt(tmp_path / "old", 4, {"w.bin": b"w" * 1000}), "job")
    make_ckpt(tmp_path / "node", 1, {"w.bin": b"v"})

    class ObjectsFail(Proxy):
        def pick_fault(self, method: str, path: str) -> str | None:
            return "503" if method == "GET" and "objects" in path else None

    with ObjectsFail(moto.url) as proxy:
        options = StoreOptions(endpoint_url=proxy.url, max_attempts=1, retry_seconds=2)
        started = time.monotonic()
        with pytest.raises(RestoreFailed) as failed:
            restore_newer(tmp_path / "node", "job", f"s3://{direct.bucket}/pre", options)
    assert (failed.value.store_step, failed.value.local_step) == (4, 1)
    assert "holds step 4" in str(failed.value) and "s of retries" in str(failed.value)
    assert 2 <= time.monotonic() - started < 30
    assert local_latest_step(tmp_path / "node") == 1
