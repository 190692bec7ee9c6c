"""Fan-out: one notice to 64 subscriber processes; latency of the LAST receipt after publish.

One daemon (``--platform none``) and 64 real subscriber processes, each with its own ZeroMQ SUB
socket on the daemon's ``ipc://`` PUB endpoint. A subscriber takes ``time.time()`` the moment a
``notice`` frame arrives and writes ``<id> <time>`` to its stdout pipe. The benchmark injects a
notice with a ``notify`` request and reads one line from every subscriber.

"Publish time" is the notice's ``received_at``, stamped by the daemon when it creates the notice
(before the store persists it with fsync, then publishes it), so the figure is an upper bound on
publish-to-last-receipt. Also reported: the spread (last minus first receipt: the fan-out alone) and
the client-side view (last receipt minus the moment this process sent the ``notify`` request).

Target (issue 2): p99 of the last receipt at most 10 ms after publish, over >= 20 notices.
Each run is done twice: with the daemon's state directory under /tmp (this machine's disk: the
store fsyncs ``notices.json`` before publishing, as on a real node) and under /dev/shm (tmpfs, where
fsync is free), which isolates the cost of that persistence. ``--quick`` uses 4 subscribers and 3
notices.

Exceptions: :class:`~_common.BenchError` when the daemon or a subscriber does not start or answer.
"""

from __future__ import annotations

import argparse
import random
import select
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import zmq
from spotguard.protocol import Kind, NotifyRequest, decode_reply, encode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchError, DaemonProcess, markdown_table, summarize, write_results  # noqa: E402

TARGET_MS = 10.0

SUBSCRIBER = r"""
import json, sys, time, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"notice")
sock.setsockopt(zmq.SUBSCRIBE, b"heartbeat")
sock.connect(sys.argv[1])
while sock.recv_multipart()[0] != b"heartbeat":
    pass
print("ready", flush=True)
while True:
    topic, data = sock.recv_multipart()
    received = time.time()
    if topic == b"notice":
        print(json.loads(data)["notice"]["id"], repr(received), flush=True)
"""


def spawn_subscribers(endpoint: str, count: int, timeout: float = 60.0) -> list[subprocess.Popen]:
    """Start ``count`` subscriber processes and wait until each has seen a heartbeat."""
    procs = [subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint], stdout=subprocess.PIPE, text=True)
             for _ in range(count)]
    for proc in procs:
        if _readline(proc, timeout) != "ready":
            raise BenchError(f"subscriber {proc.pid} did not get ready within {timeout} s")
    return procs


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else ""


def one_notice(req: zmq.Socket, subs: list[subprocess.Popen], seq: int) -> dict[str, float]:
    """Inject one notice; the three latencies of its last receipt in milliseconds."""
    sent = time.time()
    req.send(encode(NotifyRequest(kind=Kind.DRILL, deadline_seconds=600, detail=f"fanout {seq}")))
    if not req.poll(10_000):
        raise BenchError("the daemon did not answer the notify request")
    notice = decode_reply(req.recv()).data["notice"]
    published = datetime.fromisoformat(notice["received_at"]).timestamp()
    receipts = [_receipt(proc, notice["id"]) for proc in subs]
    return {"last_after_publish_ms": (max(receipts) - published) * 1000,
            "spread_ms": (max(receipts) - min(receipts)) * 1000,
            "last_after_request_ms": (max(receipts) - sent) * 1000}


def _receipt(proc: subprocess.Popen, notice_id: str, timeout: float = 10.0) -> float:
    line = _readline(proc, timeout)
    got_id, _, when = line.partition(" ")
    if got_id != notice_id:
        raise BenchError(f"subscriber {proc.pid} reported {line!r}, expected notice {notice_id}")
    return float(when)


def run(subscribers: int, notices: int, seed: int, state_base: str | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    daemon = DaemonProcess("none", state_base=state_base)
    subs: list[subprocess.Popen] = []
    ctx = zmq.Context()
    try:
        subs = spawn_subscribers(daemon.pub_endpoint, subscribers)
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(daemon.request_endpoint)
        samples = []
        for seq in range(notices):
            time.sleep(rng.uniform(0.2, 0.5))  # random phase against heartbeats and housekeeping
            samples.append(one_notice(req, subs, seq))
    finally:
        for proc in subs:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)
        daemon.stop()
    return {key: summarize([s[key] for s in samples]) for key in samples[0]} | {
        "samples": [{k: round(v, 3) for k, v in s.items()} for s in samples]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="4 subscribers, 3 notices (smoke test)")
    parser.add_argument("--subscribers", type=int, default=None, help="default 64")
    parser.add_argument("--notices", type=int, default=None, help="default 30")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--tmpfs-state", default="/dev/shm",
                        help="also run with the daemon's state dir here (a tmpfs: no disk fsync); '' to skip")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    subscribers = args.subscribers or (4 if args.quick else 64)
    notices = args.notices or (3 if args.quick else 30)
    variants = {"state_on_tmp": None, **({"state_on_tmpfs": args.tmpfs_state} if args.tmpfs_state else {})}
    results = {name: _judged(run(subscribers, notices, args.seed, base)) for name, base in variants.items()}
    params = {"subscribers": subscribers, "notices": notices, "quick": args.quick, "seed": args.seed,
              "state_dirs": {name: base or "/tmp" for name, base in variants.items()}}
    path = write_results("fanout", {"params": params, "results": results}, args.out)
    print(table(results, subscribers))
    verdict = "yes" if results["state_on_tmp"]["meets_target"] else "NO"
    print(f"\ntarget (state on /tmp, the default layout): last receipt p99 <= {TARGET_MS:g} ms after publish: "
          f"{verdict}; results in {path}")
    return 0


def _judged(result: dict[str, Any]) -> dict[str, Any]:
    return result | {"target_ms": TARGET_MS, "meets_target": result["last_after_publish_ms"]["p99_ms"] <= TARGET_MS}


def table(results: dict[str, Any], subscribers: int) -> str:
    rows = [[variant, name, subscribers, r["n"], r["p50_ms"], r["p99_ms"], r["max_ms"]]
            for variant, result in results.items()
            for name, r in result.items() if isinstance(r, dict) and "p99_ms" in r]
    return markdown_table(["daemon state dir", "measure", "subscribers", "notices", "p50 ms", "p99 ms", "max ms"],
                          rows)


if __name__ == "__main__":
    sys.exit(main())
