"""Socket-level faults between each cloud store and its emulator (a real TCP proxy on 127.0.0.1).

Every store call under a fault either succeeds with the right bytes or raises a ``StoreError``
subclass, never a raw SDK/transport exception, and returns (the read timeout bounds a stall; the
``timeout`` marker fails the test if anything hangs). The modes run side by side, a proxy each.
After the faults stop, a checkpoint uploads through a proxy and restores byte-identically, and no
manifest in the bucket is torn."""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from spotguard.storage import Durable, StoreError, StoreOptions, open_store, restore_newer
from spotguard.storage.durable import object_key

from conftest import azurite_connection_string
from tcp_fault_proxy import MODES, TcpFaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
EMULATOR = {"s3": "moto", "gcs": "fake_gcs", "azure": "azurite"}
TIGHT = {"connect_timeout": 0.5, "read_timeout": 1.0, "max_attempts": 2, "part_size": 1024 * 1024,
         "concurrency": 2, "retry_seconds": 2.0}


def target(direct, backend: str, endpoint: str) -> tuple[str, StoreOptions]:
    """URL and options for the bucket of ``direct`` reached through ``endpoint`` with tight bounds."""
    bucket = direct.url.split("/")[2]
    if backend == "azure":
        return f"az://{bucket}/pre", StoreOptions(azure_connection_string=azurite_connection_string(endpoint), **TIGHT)
    return f"{'s3' if backend == 's3' else 'gs'}://{bucket}/pre", StoreOptions(endpoint_url=endpoint, **TIGHT)


def through(direct, backend: str, endpoint: str):
    return open_store(*target(direct, backend, endpoint))


def every_call(store, tmp_path, payload: bytes) -> list[str]:
    """Run each store operation once, side by side (each mostly waits on a timeout or a backoff
    under a fault); return the outcomes. Anything not a StoreError propagates."""
    src = tmp_path / "src.bin"
    src.write_bytes(payload)
    calls = {
        "put_bytes": lambda: store.put_bytes("small", b"x" * 1000),
        "get_bytes": lambda: store.get_bytes("seed") == payload or pytest.fail("wrong bytes"),
        "put_file": lambda: store.put_file("file", src),
        "get_file": lambda: (store.get_file("seed", tmp_path / "out.bin"),
                             (tmp_path / "out.bin").read_bytes() == payload or pytest.fail("wrong bytes")),
        "get_missing": lambda: store.get_bytes("no/such/key"),
        "exists": lambda: store.exists("seed"),
        "list": lambda: list(store.list("")),
        "check": store.check,
    }

    def outcome(name: str) -> str:
        try:
            calls[name]()
            return f"{name}: ok"
        except StoreError as exc:
            return f"{name}: {type(exc).__name__}"

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(outcome, calls))


def assert_no_torn_manifest(store) -> None:
    for key in store.list("jobs/"):
        if "/manifests/" in key:
            for rel, meta in json.loads(store.get_bytes(key))["files"].items():
                body = store.get_bytes(object_key(meta["sha256"]))
                assert hashlib.sha256(body).hexdigest() == meta["sha256"], f"{key}: {rel} torn"


def under_fault(mode: str, step: int, direct, backend: str, upstream: str, payload: bytes, tmp_path,
                make_ckpt) -> int:
    """Every call and an upload (step ``step`` of job ``job``) through a proxy of its own faulting
    each connection with ``mode``, in ``tmp_path / mode``; returns how many connections were faulted."""
    tmp_path = tmp_path / mode
    tmp_path.mkdir()
    with TcpFaultProxy(upstream) as proxy:
        proxy.mode, began = mode, time.monotonic()
        flaky = through(direct, backend, proxy.url)
        durable = Durable(flaky, attempts=2)
        outcomes = every_call(flaky, tmp_path, payload)
        ckpt = make_ckpt(tmp_path / "local", step, {"w.bin": os.urandom(30_000)})
        try:
            durable.upload(ckpt, "job")
        except StoreError as exc:
            outcomes.append(f"upload: {type(exc).__name__}")
        print(backend, mode, f"{time.monotonic() - began:.1f} s", outcomes)
        assert_no_torn_manifest(direct)
        return proxy.faulted


@pytest.mark.parametrize("backend", ["s3", "gcs", "azure"])
def test_every_call_is_a_store_error_or_right_then_heals(backend, request, new_bucket, make_ckpt, tmp_path):
    """The modes run side by side, a proxy each: their time is mostly the clients' timeouts and
    backoffs, which would otherwise add up."""
    direct = new_bucket(backend)
    payload = os.urandom(20_000)
    direct.put_bytes("seed", payload)
    upstream = request.getfixturevalue(EMULATOR[backend]).url
    with ThreadPoolExecutor(len(MODES)) as pool:
        faulted = list(pool.map(lambda args: under_fault(*args, direct, backend, upstream, payload, tmp_path,
                                                         make_ckpt),
                                [(mode, step) for step, mode in enumerate(MODES, start=1)]))
    assert all(faulted), f"a mode faulted no connection: the test proves nothing ({faulted})"
    with TcpFaultProxy(upstream) as proxy:  # healed: nothing faulted
        flaky = through(direct, backend, proxy.url)
        durable = Durable(flaky, attempts=2)
        final = {"w.bin": os.urandom(50_000), "sub/b.bin": os.urandom(5_000)}
        durable.upload(make_ckpt(tmp_path / "local", 99, final), "job")
        restored = Durable(flaky).restore("job", tmp_path / "fresh")
    assert_no_torn_manifest(direct)
    assert restored.name == "step-0000000099"
    assert all((restored / rel).read_bytes() == data for rel, data in final.items())


@pytest.mark.parametrize("backend", ["s3", "gcs", "azure"])
def test_restore_at_job_start_fails_only_as_a_store_error(backend, request, new_bucket, tmp_path):
    """Issue 12.3: a brand-new job (nothing local, no ``latest`` in the bucket) whose store resets
    connections gets a StoreError, which ``Run`` logs before training on; never a raw exception."""
    direct = new_bucket(backend)
    with TcpFaultProxy(request.getfixturevalue(EMULATOR[backend]).url, reset_after=20) as proxy:
        proxy.mode = "reset"  # inside every reply's headers: even a 404 does not get through
        with pytest.raises(StoreError):
            restore_newer(tmp_path / "ckpt", "job", *target(direct, backend, proxy.url))
        assert proxy.faulted
