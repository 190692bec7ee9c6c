"""Training step-time inflation while the peer tier copies a committed part (issue 30: <= 3 %).

    python benchmarks/bench_peer_inflation.py [--mb 256] [--rounds 5] [--threads 1]
    python benchmarks/bench_peer_inflation.py --quick        # 32 MiB, 2 rounds

Two real daemons on this machine, as a node and its partner in a ring: the sender (its checkpoint
root holds the part; ``peer.partners`` names the receiver; no bucket) and the receiver
(``peer.listen`` on loopback), both with their default priorities (``storage.upload_nice``: the
copy's sending thread and the receiver's serving threads run at nice 19). A node in a ring does
both at once: it sends its part and receives its neighbour's, so the one training loop here bears
both sides' CPU. The victim is :class:`_upload_inflation.TrainLoop` (torch, ``--threads`` threads).

Each round: the loop steps ``--idle`` seconds with nothing else running, then a ``CommitRequest``
of a fresh node-local part (``--mb`` MiB in 8 files, copies of one set of random files under a
new step, page cache dropped so the sender reads the disk) goes to the sender, and the loop steps
until the part is committed at the receiver. Inflation: the median step while copying over the
median idle step, over all rounds (``results/peer_inflation.json``).
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
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).parent))
from _common import DaemonProcess, write_results  # noqa: E402
from _upload_inflation import CpuMeter, TrainLoop  # noqa: E402
from bench_peer import evict, make_part  # noqa: E402
from spotguard.protocol import CommitRequest, RegisterRequest, decode_reply, encode  # noqa: E402

JOB, SLOT, SECRET = "bench", "ranks-0-1", "the-inflation-benchmark-secret"


def request(daemon: DaemonProcess, message) -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as req:
        req.setsockopt(zmq.LINGER, 0)
        req.connect(daemon.request_endpoint)
        req.send(encode(message))
        if not req.poll(10_000):
            raise RuntimeError(f"no answer: {daemon.output()[-1000:]}")
        reply = decode_reply(req.recv())
        if not reply.ok:
            raise RuntimeError(f"refused: {reply.error}")


def new_step(template: Path, root: Path, step: int) -> Path:
    """The template part copied to ``root/step-N`` (not hard-linked: the daemon refuses a linked file),
    its manifest rewritten."""
    dest = root / f"step-{step:010d}"
    shutil.copytree(template, dest)
    (dest / "manifest.json").unlink()
    manifest = json.loads((template / "manifest.json").read_text())
    manifest["step"] = step
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def wait_ready(daemon: DaemonProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (daemon.runtime_dir / "requests.sock").exists():
        if daemon.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"daemon did not start: {daemon.output()[-2000:]}")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle steps before each copy")
    parser.add_argument("--threads", type=int, default=1, help="the training loop's torch threads")
    parser.add_argument("--port", type=int, default=0, help="the receiver's peer port (0: a free one)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.mb, args.rounds, args.idle = 32, 2, 1.0
    work = Path(tempfile.mkdtemp(prefix="bench-peer-infl-"))
    root = work / "root"
    template = make_part(work / "template", args.mb, 8)
    root.mkdir()
    if not args.port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{args.port}"
    receiver = DaemonProcess(env={"SPOTGUARD_PEER__LISTEN": f"127.0.0.1:{args.port}", "SPOTGUARD_PEER__SECRET": SECRET,
                                  "SPOTGUARD_STORAGE__URL": "none"})
    sender = DaemonProcess(env={"SPOTGUARD_PEER__PARTNERS": url, "SPOTGUARD_PEER__SECRET": SECRET,
                                "SPOTGUARD_STORAGE__URL": "none", "SPOTGUARD_CHECKPOINT_ROOT": str(root)})
    import torch

    loop = TrainLoop()
    torch.set_num_threads(args.threads)
    idle, during, rounds = [], [], []
    try:
        wait_ready(receiver)
        wait_ready(sender)
        request(receiver, RegisterRequest(pid=os.getpid(), job_id=JOB, signal=False))  # the partner runs the job too
        for r in range(1, args.rounds + 1):
            part = new_step(template, root, 10 * r)
            os.sync()
            evict(part)
            idle += loop.run(args.idle)
            meter = CpuMeter({"sender": sender.proc.pid, "receiver": receiver.proc.pid, "bench": os.getpid()})
            held = receiver.state_dir / "peer" / JOB / SLOT / part.name / "manifest.json"
            request(sender, CommitRequest(pid=os.getpid(), job_id=JOB, path=str(part), step=10 * r,
                                          size_bytes=args.mb << 20))
            began = time.monotonic()
            steps = loop.run(300, stop=held.exists)
            seconds = time.monotonic() - began
            if not held.exists():
                raise RuntimeError(f"round {r}: the part never reached the partner:\n{sender.output()[-2000:]}")
            during += steps
            rounds.append({"copy_s": round(seconds, 2), "MBps": round((args.mb << 20) / seconds / 1e6, 1),
                           "steps": len(steps), "median_ms": round(statistics.median(steps), 3), **meter.read()})
            shutil.rmtree(part)
    finally:
        sender.stop()
        receiver.stop()
        shutil.rmtree(work, ignore_errors=True)
    base, busy = statistics.median(idle), statistics.median(during)
    result = {"mb": args.mb, "rounds": args.rounds, "threads": args.threads,
              "idle_p50_ms": round(base, 3), "copying_p50_ms": round(busy, 3),
              "inflation_pct": round((busy / base - 1) * 100, 2), "steps_idle": len(idle),
              "steps_copying": len(during), "per_round": rounds}
    out = write_results(f"peer_inflation_t{args.threads}" if args.threads != 1 else "peer_inflation", result,
                        Path(args.out) if args.out else None)
    print(f"{args.mb} MiB part, {args.rounds} rounds, loop on {args.threads} thread(s), load {os.getloadavg()[0]:.1f}")
    print(f"  step p50 idle {base:.2f} ms, while copying {busy:.2f} ms: inflation {result['inflation_pct']:+.2f} %")
    for i, row in enumerate(rounds, 1):
        print(f"  round {i}: copied in {row['copy_s']} s ({row['MBps']} MB/s), {row['steps']} steps, "
              f"sender {row['sender_cpu_s']} s / receiver {row['receiver_cpu_s']} s CPU")
    print(f"  -> {out}")


if __name__ == "__main__":
    main()
