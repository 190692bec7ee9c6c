"""Node-local roots in the store: time to global commit, and what a fresh node fetches.

Each trial commits, per node, a node-local checkpoint of its ranks' parts (one random
``--part-mb`` file per rank, the layout and ``node`` section a node's leader writes), uploads every
node's part with ``Durable.upload`` as each node's daemon does, and measures:

- **global commit**: from the last node's part manifest being in the store to the global manifest
  and ``latest`` written (listing the parts, reading node 0's, one PUT of the manifest and one of
  the pointer); baseline in the same run: a shared-directory checkpoint's manifest + pointer
  (``Durable.upload`` of one whole checkpoint whose objects are all in the store already).
- **fresh node**: a restore into an empty root of only its ranks' parts plus rank 0's
  (``ranks=``), against the whole checkpoint on every node (the baseline): seconds and bytes.

``--scale 8 128 1024`` measures the cost of one step as N grows instead: N simulated nodes of one
rank each upload their part of one step with ``Durable.upload``, one after another (each node's
last is the one that completes the set), through a store wrapper that counts requests
(``_counting_store.py``): requests per step, bytes read, global-manifest writes, and the time from
the last part manifest's PUT to the global manifest's PUT (the requests before the global commit
include it); ``--retention`` then runs the daemon's ``prune`` twice, as node 0's daemon does after
its upload (the other nodes' daemons leave a node-local job's retention to node 0), counted apart:
the first reads the new step's parts and writes its index, the second shows a prune's cost with
nothing new.

The store is the S3 emulator (moto) by default, ``--backend file`` for a local directory. The time
from a relaunch to the first resumed step adds the job's start (torchrun, imports) to the restore;
it is not measured here.

Usage::

    python benchmarks/bench_node_parts.py [--nodes 4] [--ranks 2] [--part-mb 8] [--trials 5]
    python benchmarks/bench_node_parts.py --quick      # 2 nodes x 2 ranks, 1 MiB parts, 2 trials
    python benchmarks/bench_node_parts.py --scale 8 128 [--retention] [--backend file]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "storage"))

from _common import markdown_table, summarize, write_results  # noqa: E402
from bench_recovery import open_bucket, start_emulator  # noqa: E402

from _counting_store import CountingStore  # noqa: E402
from spotguard.storage import Durable  # noqa: E402
from spotguard.storage.durable import GC_GRACE_SECONDS, manifest_key  # noqa: E402


def node_part(root: Path, step: int, node: int, ranks: list[int], nodes: int, world: int, size: int) -> Path:
    """A committed node-local checkpoint of ``ranks`` (one ``size``-byte file each)."""
    ckpt = root / f"step-{step:010d}"
    files = {}
    for r in ranks:
        (ckpt / f"rank-{r}").mkdir(parents=True)
        data = os.urandom(size)
        (ckpt / f"rank-{r}" / "w.bin").write_bytes(data)
        files[f"rank-{r}/w.bin"] = {"size": size, "sha256": hashlib.sha256(data).hexdigest()}
    per = world // nodes  # contiguous ranks per node, as torchrun places them
    node = {"index": node, "nodes": nodes, "leader": ranks[0], "ranks": ranks, "digests": ["0" * 64] * world,
            "layout": [[k, per] for k in range(nodes)]}
    (ckpt / "manifest.json").write_text(json.dumps({"format": "spotguard-checkpoint", "version": 1, "step": step,
                                                    "world_size": world, "digest": "0" * 64, "job_id": "bench",
                                                    "node": node, "files": files}))
    return ckpt


def trial(durable: Durable, work: Path, step: int, args: argparse.Namespace) -> dict:
    world, size = args.nodes * args.ranks, args.part_mb << 20
    parts = [node_part(work / f"node-{k}", step, k, list(range(k * args.ranks, (k + 1) * args.ranks)),
                       args.nodes, world, size) for k in range(args.nodes)]
    for ckpt in parts[:-1]:
        durable.upload(ckpt, "bench")
    last = json.loads((parts[-1] / "manifest.json").read_text())
    started = time.monotonic()
    durable.upload(parts[-1], "bench")  # its objects, its part manifest, then the global commit
    uploaded = time.monotonic() - started
    assert durable.latest("bench") == step, "the global manifest was not written"
    # the commit alone, as it runs after the last part manifest is in the store (same calls again)
    started = time.monotonic()
    assert durable._complete("bench", step)
    durable._advance_pointer("bench", step)
    global_commit = time.monotonic() - started
    # baseline: one shared-directory checkpoint (objects already stored): manifest + pointer
    shared = work / "shared" / f"step-{step:010d}"
    shared.mkdir(parents=True)
    (shared / "manifest.json").write_text(json.dumps({**{k: v for k, v in last.items() if k != "node"},
                                                      "files": durable.manifest("bench", step)["files"]}))
    for rel in durable.manifest("bench", step)["files"]:
        (shared / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(work / f"node-{int(rel.split('/')[0][5:]) // args.ranks}" / f"step-{step:010d}" / rel, shared / rel)
    started = time.monotonic()
    durable.upload(shared, "bench-shared")
    shared_commit = time.monotonic() - started
    fresh = list(range((args.nodes - 1) * args.ranks, world))  # the last node, replaced by a fresh one
    started = time.monotonic()
    mine = durable.restore("bench", work / f"fresh-{step}", ranks=fresh)
    own_s = time.monotonic() - started
    started = time.monotonic()
    whole = durable.restore("bench", work / f"whole-{step}")
    whole_s = time.monotonic() - started
    size_of = lambda p: sum(f.stat().st_size for f in p.rglob("*.bin"))  # noqa: E731
    return {"last_part_upload_ms": uploaded * 1000, "global_commit_ms": global_commit * 1000,
            "shared_commit_ms": shared_commit * 1000, "fresh_own_s": own_s, "fresh_whole_s": whole_s,
            "fresh_own_bytes": size_of(mine), "fresh_whole_bytes": size_of(whole)}


def scale(store, work: Path, nodes: int, retention: bool) -> dict:
    """One step of ``nodes`` one-rank nodes through a :class:`CountingStore`: what it cost; with
    ``retention``, node 0's daemon's prune after it (it reads the step's parts and writes the
    step's index) and a second prune (a prune with no new step: the index and what it read before)."""
    counting = CountingStore(store)
    durable, job = Durable(counting), f"scale-{nodes}"
    parts = [node_part(work / f"scale-{nodes}" / f"node-{k}", 1, k, [k], nodes, nodes, 1024) for k in range(nodes)]
    started = time.monotonic()
    for ckpt in parts:
        durable.upload(ckpt, job)
    seconds = time.monotonic() - started
    assert durable.latest(job) == 1, "the global manifest was not written"
    requests, gets, bytes_read = counting.requests, counting.counts["get_bytes"], counting.bytes_read
    last_part = next(times[-1] for key, times in counting.put_times.items()
                     if key.startswith(f"jobs/{job}/parts/step-0000000001/node-{nodes - 1}."))
    global_puts = counting.put_times[manifest_key(job, 1)]
    prunes = []
    for _ in range(2 if retention else 0):  # node 0's daemon, once per step (the other nodes' do not prune)
        before, gets_before = counting.requests, counting.counts["get_bytes"]
        durable.prune(job, 3, grace=GC_GRACE_SECONDS)
        prunes.append((counting.requests - before, counting.counts["get_bytes"] - gets_before))
    return {"nodes": nodes, "requests": requests, "per_node": round(requests / nodes, 1),
            "gets": gets, "bytes_read": bytes_read,
            "global_writes": len(global_puts), "last_part_to_global_ms": round((global_puts[0] - last_part) * 1000, 1),
            "seconds": round(seconds, 2), "prunes": prunes, "by_method": dict(counting.counts)}


def in_bucket(args: argparse.Namespace, run) -> list[dict]:
    """``run(store, work)`` against a new bucket of ``args.backend`` (the emulator started and stopped)."""
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-parts-") as tmp:
        work = Path(tmp)
        emulator = start_emulator("s3", work) if args.backend == "s3" else None
        try:
            store = open_bucket(args.backend, emulator.url if emulator else "", f"sg-{uuid.uuid4().hex[:12]}",
                                work, create=True)
            return run(store, work)
        finally:
            if emulator:
                emulator.stop()


def main_scale(args: argparse.Namespace) -> None:
    rows = in_bucket(args, lambda store, work: [scale(store, work, n, args.retention) for n in args.scale])
    params = {"scale": args.scale, "backend": args.backend, "retention": args.retention}
    path = write_results("node_parts_scale", {"params": params, "results": rows}, args.out)
    print(markdown_table(["nodes", "requests per step", "per node", "GETs", "bytes read", "global writes",
                          "last part -> global (ms)", "step (s)", "prunes: requests (GETs)"],
                         [[r["nodes"], r["requests"], r["per_node"], r["gets"], r["bytes_read"], r["global_writes"],
                           r["last_part_to_global_ms"], r["seconds"],
                           ", ".join(f"{n} ({g})" for n, g in r["prunes"]) or "-"] for r in rows]))
    print(f"results: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--part-mb", type=int, default=8)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--backend", default="s3", choices=("s3", "file"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--scale", type=int, nargs="+", help="N simulated nodes: the cost of one step")
    parser.add_argument("--retention", action="store_true", help="with --scale: node 0 prunes once per step")
    args = parser.parse_args()
    if args.scale:
        return main_scale(args)
    if args.quick:
        args.nodes, args.ranks, args.part_mb, args.trials = 2, 2, 1, 2
    rows = in_bucket(args, lambda store, work: [trial(Durable(store), work / f"t{step}", step, args)
                                                for step in range(1, args.trials + 1)])
    ms = lambda key: summarize([r[key] for r in rows])  # noqa: E731
    results = {"global_commit": ms("global_commit_ms"), "shared_commit": ms("shared_commit_ms"),
               "last_part_upload": ms("last_part_upload_ms"),
               "fresh_own_s": [round(r["fresh_own_s"], 3) for r in rows],
               "fresh_whole_s": [round(r["fresh_whole_s"], 3) for r in rows],
               "fresh_own_bytes": rows[0]["fresh_own_bytes"], "fresh_whole_bytes": rows[0]["fresh_whole_bytes"]}
    params = {k: getattr(args, k) for k in ("nodes", "ranks", "part_mb", "trials", "backend", "quick")}
    path = write_results("node_parts", {"params": params, "results": results}, args.out)
    print(markdown_table(["measure", "p50 ms", "max ms"],
                         [[name, results[key]["p50_ms"], results[key]["max_ms"]] for name, key in
                          (("global commit after the last part", "global_commit"),
                           ("baseline: shared-directory manifest + pointer", "shared_commit"),
                           ("last node's whole upload (objects, part, commit)", "last_part_upload"))]))
    print(markdown_table(["fresh node", "bytes", "seconds per trial"],
                         [["its ranks' parts + rank 0's", results["fresh_own_bytes"], results["fresh_own_s"]],
                          ["baseline: the whole checkpoint", results["fresh_whole_bytes"], results["fresh_whole_s"]]]))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
