"""The peer tier's copy and restore against the link's own speed, and against the bucket's restore.

One node-local part (``--mb`` MiB in ``--files`` files, the layout a node's leader commits) is
pushed to a peer server (:mod:`spotguard_daemon.core.peer_server`) and fetched back into an empty
root with :class:`spotguard.storage.peer.PeerClient`, as the replicating daemon and a fresh node do.
Baselines in the same run, over the same loopback link: a raw TCP copy of the same bytes
(``socket.sendfile`` into a reader that discards them: the link's speed with nothing on top), and
``Durable.restore`` of the same part from a ``file://`` store (the bucket path without a network).
The page cache is dropped for the part's files before every copy or restore (``posix_fadvise``),
so each reads from the disk as a fresh node's partner does. Medians of ``--trials``.

    python benchmarks/bench_peer.py [--mb 256] [--files 8] [--trials 5]
    python benchmarks/bench_peer.py --quick         # 16 MiB, 2 trials
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine
from spotguard.storage.peer import PeerClient
from spotguard_daemon.core.peer_server import PeerServer

SECRET = "benchmark-secret-of-some-length"
JOB, SLOT = "bench", "ranks-0-1"


def make_part(root: Path, mb: int, files: int) -> Path:
    """A committed node-local part: ``files`` random files of ``mb`` MiB in all, and its manifest."""
    import hashlib

    part = root / "step-0000000010"
    (part / "rank-0").mkdir(parents=True)
    entries = {}
    each = (mb << 20) // files
    for i in range(files):
        data = os.urandom(each)
        rel = f"rank-0/tensors/{i:06d}.bin" if i else "rank-0/small.bin"
        (part / rel).parent.mkdir(parents=True, exist_ok=True)
        (part / rel).write_bytes(data)
        entries[rel] = {"size": each, "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": "spotguard-checkpoint", "version": 1, "step": 10, "created": time.time(),
                "job_id": JOB, "files": entries, "node": {"nodes": 2, "leader": 0, "ranks": [0, 1]}}
    (part / "manifest.json").write_text(json.dumps(manifest))
    os.sync()
    return part


def evict(path: Path) -> None:
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_link(part: Path) -> float:
    """Seconds to send every file of ``part`` over one loopback TCP connection (sendfile) to a
    reader that discards the bytes."""
    files = [p for p in part.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def sink() -> None:
        conn, _ = server.accept()
        got = 0
        with conn:
            while got < total and (chunk := conn.recv(1 << 20)):
                got += len(chunk)
        done.set()

    threading.Thread(target=sink, daemon=True).start()
    evict(part)
    began = time.perf_counter()
    with socket.create_connection(server.getsockname()) as conn:
        for path in files:
            with open(path, "rb") as data:
                conn.sendfile(data)
    done.wait(600)
    server.close()
    return time.perf_counter() - began


def bucket_restore(part: Path, work: Path) -> float:
    from spotguard.storage import Durable, open_store

    store = work / "bucket"
    durable = Durable(open_store(f"file://{store}"))
    if not store.exists():  # the same files as one whole checkpoint (no node section: no global commit)
        whole = work / "whole" / part.name
        shutil.copytree(part, whole)
        manifest = json.loads((whole / "manifest.json").read_text())
        manifest.pop("node")
        (whole / "manifest.json").write_text(json.dumps(manifest))
        durable.upload(whole, JOB)
    dest = work / "bucket-restore"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    evict(store)
    began = time.perf_counter()
    durable.restore(JOB, dest, step=10)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "peer.json"))
    args = parser.parse_args()
    if args.quick:
        args.mb, args.trials = 16, 2
    work = Path(tempfile.mkdtemp(prefix="bench-peer-", dir=args.dir))
    samples: dict[str, list[float]] = {"raw_link_s": [], "push_s": [], "fetch_s": [], "bucket_restore_s": []}
    try:
        part = make_part(work / "node-b", args.mb, args.files)
        server = PeerServer(work / "held", SECRET, keep=2, timeout=60, jobs=lambda: {JOB})
        host, port = server.start("127.0.0.1", 0)
        url = f"http://{host}:{port}"
        for _ in range(args.trials):
            samples["raw_link_s"].append(raw_link(part))
            evict(part)
            with PeerClient(url, SECRET, JOB) as client:
                began = time.perf_counter()
                client.push(SLOT, 10, part)
                samples["push_s"].append(time.perf_counter() - began)
                held = work / "held" / JOB / SLOT / "step-0000000010"
                os.sync()
                evict(held)
                fresh = work / "node-c"
                shutil.rmtree(fresh, ignore_errors=True)
                fresh.mkdir()
                began = time.perf_counter()
                client.fetch(SLOT, 10, fresh)
                samples["fetch_s"].append(time.perf_counter() - began)
            samples["bucket_restore_s"].append(bucket_restore(part, work))
        server.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    nbytes = args.mb << 20
    medians = {k: statistics.median(v) for k, v in samples.items()}
    rates = {k.replace("_s", "_mb_s"): nbytes / v / 1e6 for k, v in medians.items()}
    result = {"mb": args.mb, "files": args.files, "trials": args.trials, "machine": machine(), "medians": medians,
              "rates": rates, "fetch_of_link": medians["raw_link_s"] / medians["fetch_s"],
              "push_of_link": medians["raw_link_s"] / medians["push_s"], "samples": samples}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{args.mb} MiB part in {args.files} files, medians of {args.trials}, load {os.getloadavg()[0]:.1f}")
    for key, seconds in medians.items():
        print(f"  {key:18s} {seconds:7.3f} s  {nbytes / seconds / 1e6:8.0f} MB/s")
    print(f"  peer fetch at {result['fetch_of_link']:.0%} of the raw link, push at {result['push_of_link']:.0%}")


if __name__ == "__main__":
    main()
