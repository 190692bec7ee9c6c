"""restore_newer on every backend: restore only when the store is ahead of the local root."""

from __future__ import annotations

from spotguard.storage import Durable, restore_newer
from spotguard.storage.fresh_node import local_latest_step, store_from_env


def test_restores_only_when_the_store_is_ahead(store, tmp_path, make_ckpt):
    durable = Durable(store)
    source = tmp_path / "old-node"
    durable.upload(make_ckpt(source, 5, {"w.bin": b"w" * 100}), "default")
    durable.upload(make_ckpt(source, 9, {"w.bin": b"v" * 100}), "default")
    node = tmp_path / "new-node"
    url = _url(store)
    restored = restore_newer(node, "", url, _options(store))
    assert restored is not None and restored.name == "step-0000000009"
    assert local_latest_step(node) == 9 and (restored / "w.bin").read_bytes() == b"v" * 100
    assert restore_newer(node, "", url, _options(store)) is None  # as new as the store now
    make_ckpt(node, 12, {"w.bin": b"u"})
    assert restore_newer(node, "", url, _options(store)) is None  # local is ahead


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
