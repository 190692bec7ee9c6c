"""The stall of the first save after a fork: staging buffers kept from children, or shared with them.

A DataLoader forks its workers at every epoch's start (``persistent_workers=False``, torch's
default), and at the first ``iter()`` otherwise. Memory a child shares copy-on-write makes the
parent's next write to it fault and copy each page; the next save's snapshot writes every page of
the staging buffers. spotguard keeps them from forked children (``MADV_DONTFORK``,
``checkpoint/_hugepages.py``); the baseline arm, ``shared``, makes them as before (inherited).

Each round, per arm, in one process: a Checkpointer saves the state once (the buffers are made and
faulted in), then the save call (the stall) is timed three times: with no child (a warm-up), right
after forking a child that sleeps (as a loader worker would live on), and with no child again (the
figure reported). Rounds alternate the arms' order.

    python benchmarks/bench_fork_stall.py --gib 1 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ARMS = ("private", "shared")


def one(arm: str, gib: float, work: Path) -> dict[str, float]:
    import torch

    from spotguard.checkpoint import Checkpointer, staging

    if arm == "shared":  # the baseline: buffers made as before, inherited by every child
        made = staging.aligned_bytes
        staging.aligned_bytes = lambda nbytes, private=False: made(nbytes, False)
    try:
        tensors = max(1, int(gib * 1024 / 64))
        state = {"w": {str(i): torch.ones(16 << 20) for i in range(tensors)}}  # 64 MiB each
        ck = Checkpointer(work / arm, keep=1)
        try:
            ck.save(1, state, blocking=True)
            out = {}
            for step, fork in ((2, False), (3, True), (4, False)):  # step 2 warms up; 4 is the no-child figure
                pid = os.fork() if fork else None
                if pid == 0:
                    time.sleep(600)
                    os._exit(0)
                try:
                    began = time.perf_counter()
                    ck.save(step, state)
                    out["stall_after_fork_s" if fork else "stall_s"] = time.perf_counter() - began
                    ck.wait()
                finally:
                    if pid:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
            return out
        finally:
            ck.close()
    finally:
        if arm == "shared":
            staging.aligned_bytes = made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="scratch directory")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fork_stall.json"))
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # a child: one arm, one round
    args = parser.parse_args()
    if args.arm:
        work = Path(tempfile.mkdtemp(prefix="forkstall-", dir=args.dir))
        try:
            print(json.dumps(one(args.arm, args.gib, work)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    import subprocess

    samples: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            cmd = [sys.executable, __file__, "--arm", arm, "--gib", str(args.gib)]
            cmd += ["--dir", args.dir] if args.dir else []
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            samples[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {arm: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for arm, runs in samples.items()}
    result = {"gib": args.gib, "rounds": args.rounds, "cpus": os.cpu_count(), "medians": medians, "samples": samples}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| staging buffers | stall, no child | stall right after a fork | ratio |\n|---|---|---|---|")
    for arm, m in medians.items():
        print(f"| {arm} | {m['stall_s']:.3f} s | {m['stall_after_fork_s']:.3f} s | "
              f"{m['stall_after_fork_s'] / m['stall_s']:.1f}x |")


if __name__ == "__main__":
    main()
