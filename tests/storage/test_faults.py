"""Fault injection between the S3 store and moto: resets, 500/503 and slow replies at seeded random
requests. With retries every checkpoint eventually becomes durable, and at no moment does a manifest
name an object that is missing or corrupt."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from spotguard.storage import Durable, StoreError
from spotguard.storage.durable import object_key

from storage_proxy import Proxy

pytestmark = pytest.mark.slow


def assert_every_manifest_sound(store) -> None:
    """Read the bucket directly (not through the proxy) and check each manifest's objects."""
    for key in store.list("jobs/"):
        if "/manifests/" in key:
            for rel, meta in json.loads(store.get_bytes(key))["files"].items():
                body = store.get_bytes(object_key(meta["sha256"]))
                assert hashlib.sha256(body).hexdigest() == meta["sha256"], f"{key}: {rel} corrupt"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_checkpoint_becomes_durable_despite_faults(seed, moto, new_bucket, make_ckpt, tmp_path):
    direct = new_bucket("s3")
    bucket = direct.url.split("/")[2]
    with Proxy(moto.url, seed=seed, fault_rate=0.5, max_faults=80, slow_s=0.1) as proxy:
        from spotguard.storage import StoreOptions, open_store

        flaky = open_store(f"s3://{bucket}/pre", StoreOptions(endpoint_url=proxy.url, part_size=5 * 1024 * 1024,
                                                              concurrency=4, max_attempts=2))
        durable = Durable(flaky, attempts=1)
        frozen = {"big.bin": os.urandom(6 * 1024 * 1024)}  # multipart: 2 parts
        attempts, failures = 0, []
        for step in range(1, 5):
            ckpt = make_ckpt(tmp_path / "local", step, frozen | {f"head{step}.bin": os.urandom(200_000)})
            for _ in range(10):
                attempts += 1
                try:
                    durable.upload(ckpt, "job")
                    break
                except StoreError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                finally:
                    assert_every_manifest_sound(direct)
            else:
                pytest.fail(f"step {step} never became durable")
        assert proxy.injected, "no fault was injected: the test proves nothing"
        print(f"seed {seed}: {len(proxy.injected)} faults, {attempts} upload attempts, failures: {failures}")
    checker = Durable(direct)
    assert checker.list("job") == [1, 2, 3, 4] and checker.latest("job") == 4
    assert all(checker.verify("job", step) == [] for step in range(1, 5))
    restored = checker.restore("job", tmp_path / "fresh")
    assert (restored / "big.bin").read_bytes() == frozen["big.bin"]
