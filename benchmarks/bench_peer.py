"""The peer tier's copy and restore against the link's own speed, and against the bucket's restore.

One node-local part (``--mb`` MiB in ``--files`` files, the layout a node's leader commits) is
pushed to a peer server (:mod:`spotguard_daemon.core.peer_server`) and fetched back into an empty
root with :class:`spotguard.storage.peer.PeerClient`, as the replicating daemon and a fresh node do.
Baselines in the same run, over the same link: a raw TCP copy of the same bytes (``socket.sendfile``
into a reader that discards them: the link's speed with nothing on top), ``dd conv=fsync`` of as many
bytes beside the fetch's root (the disk's side: a fetch writes and syncs every byte it gets), and
``Durable.restore`` of the same part from a ``file://`` store (the bucket path without a network).
The partner's server runs in a process of its own, as a partner's daemon does.

The link is loopback by default. With ``--link-mbit N`` (root: ``ip netns``, ``tc``) it is a veth
pair between two network namespaces (``tests/multinode/_twonodes.py``), each end's egress shaped
with ``tc`` to N Mbit/s: the server listens in node a's namespace, and the pushing and fetching
client (and the raw copy's sender) connects from node b's, as across a cluster's NICs.
The page cache is dropped for the part's files before every copy or restore (``posix_fadvise``),
so each reads from the disk as a fresh node's partner does. Medians of ``--trials``.

    python benchmarks/bench_peer.py [--mb 256] [--files 8] [--trials 5] [--link-mbit 8000]
    python benchmarks/bench_peer.py --quick         # 16 MiB, 2 trials
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multinode"))
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


class Link:
    """Where the two ends live: loopback in this namespace, or nodes a and b of a shaped pair."""

    def __init__(self, stack: ExitStack, mbit: int) -> None:
        self.host, self.server_ns, self.client_ns = "127.0.0.1", None, None
        if mbit:
            from _twonodes import Cluster, netns_available

            why = netns_available()
            if why:
                raise SystemExit(f"--link-mbit needs network namespaces: {why}")
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-peer-ns-")))
            cluster = Cluster(work, work, 2, mbit)
            stack.callback(cluster.destroy)
            cluster.create()
            a, b = cluster.nodes
            self.host, self.server_ns, self.client_ns = a.addr, a.name, b.name

    def server_side(self):
        return _in(self.server_ns)

    def client_side(self):
        return _in(self.client_ns)


def _in(netns: str | None):
    if netns is None:
        return nullcontext()
    from _bucket import in_netns

    return in_netns(netns)


def raw_link(part: Path, link: Link) -> float:
    """Seconds to send every file of ``part`` over one TCP connection (sendfile) to a reader that
    discards the bytes."""
    files = [p for p in part.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    with link.server_side():
        server = socket.create_server((link.host, 0))
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
    with link.client_side():
        conn = socket.create_connection(server.getsockname())
    with conn:
        for path in files:
            with open(path, "rb") as data:
                conn.sendfile(data)
    done.wait(600)
    server.close()
    return time.perf_counter() - began


def dd_write(mb: int, work: Path) -> float:
    """Seconds for ``dd conv=fsync`` to write ``mb`` MiB beside the fetch's root: the disk's side of a
    restore, which writes (and syncs) every byte it receives."""
    target = work / "dd.bin"
    began = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={max(1, mb // 16)}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - began
    target.unlink()
    return seconds


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


def serve(held: Path, host: str) -> None:
    """The partner's daemon side: a peer server on ``host``, its address on stdout, until stdin ends."""
    server = PeerServer(held, SECRET, keep=2, timeout=60, jobs=lambda: {JOB})
    print(*server.start(host, 0), flush=True)
    sys.stdin.read()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--link-mbit", type=int, default=0,
                        help="a veth pair between two namespaces shaped to this rate (0: loopback)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # the partner's process
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=None, help="default: results/peer.json (peer-link.json with --link-mbit)")
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve), args.host)
        return
    args.out = args.out or str(Path(__file__).parent / "results" / ("peer-link.json" if args.link_mbit else "peer.json"))
    if args.quick:
        args.mb, args.trials = 16, 2
    work = Path(tempfile.mkdtemp(prefix="bench-peer-", dir=args.dir))
    samples: dict[str, list[float]] = {"raw_link_s": [], "dd_write_s": [], "push_s": [], "fetch_s": [],
                                       "bucket_restore_s": []}
    stack = ExitStack()
    try:
        link = Link(stack, args.link_mbit)
        part = make_part(work / "node-b", args.mb, args.files)
        with link.server_side():  # the partner: a process of its own (a child stays in this namespace)
            server = subprocess.Popen([sys.executable, __file__, "--serve", str(work / "held"), "--host", link.host],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        stack.callback(server.wait, 30)
        stack.callback(server.stdin.close)
        host, port = server.stdout.readline().split()
        url = f"http://{host}:{port}"
        for _ in range(args.trials):
            samples["raw_link_s"].append(raw_link(part, link))
            samples["dd_write_s"].append(dd_write(args.mb, work))
            evict(part)
            with link.client_side(), PeerClient(url, SECRET, JOB) as client:
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
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)
    nbytes = args.mb << 20
    medians = {k: statistics.median(v) for k, v in samples.items()}
    rates = {k.replace("_s", "_mb_s"): nbytes / v / 1e6 for k, v in medians.items()}
    result = {"mb": args.mb, "files": args.files, "trials": args.trials, "link_mbit": args.link_mbit,
              "machine": machine(), "medians": medians,
              "rates": rates, "fetch_of_link": medians["raw_link_s"] / medians["fetch_s"],
              "push_of_link": medians["raw_link_s"] / medians["push_s"],
              "fetch_of_bound": max(medians["raw_link_s"], medians["dd_write_s"]) / medians["fetch_s"],
              "samples": samples}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    where = f"a veth pair shaped to {args.link_mbit} Mbit/s" if args.link_mbit else "loopback"
    print(f"{args.mb} MiB part in {args.files} files over {where}, medians of {args.trials}, "
          f"load {os.getloadavg()[0]:.1f}")
    for key, seconds in medians.items():
        print(f"  {key:18s} {seconds:7.3f} s  {nbytes / seconds / 1e6:8.0f} MB/s")
    print(f"  peer fetch at {result['fetch_of_link']:.0%} of the raw link, push at {result['push_of_link']:.0%}; "
          f"fetch at {result['fetch_of_bound']:.0%} of the slower of the link and the disk's write")


if __name__ == "__main__":
    main()
