"""Two ranks of a small ``spotguard.Run`` job over gloo, for the peer-lost tests (no torchrun).

    python _peer_job.py --rank R --init file:///tmp/x --ckpt-dir DIR --peer-timeout 2 [--steps N]
        [--evaluate-at STEP --evaluate-for SECONDS] [--after-loop SECONDS]

No collective of its own and no save (whose persist would wait for the peer too): the library's
agreement is where a rank waits for a lost peer.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

import spotguard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--peer-timeout", type=float, required=True)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--evaluate-at", type=int, default=None, help="a long evaluation in this step")
    p.add_argument("--evaluate-for", type=float, default=0.0)
    p.add_argument("--after-loop", type=float, default=0.0, help="seconds of work after the loop")
    args = p.parse_args()
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=2)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = spotguard.Run(args.ckpt_dir, model=model, optimizer=optimizer, save_every=10_000, daemon=False,
                        peer_timeout=args.peer_timeout)
    with run:
        for step in run.steps(args.steps):
            optimizer.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            time.sleep(0.01)
            if step == args.evaluate_at:  # longer than peer_timeout, with heartbeats
                until = time.monotonic() + args.evaluate_for
                while time.monotonic() < until:
                    time.sleep(0.2)
                    run.heartbeat()
        time.sleep(args.after_loop)  # an evaluation after training: no boundary comes any more
    print(f"rank={args.rank} done step={run.step}", flush=True)


if __name__ == "__main__":
    main()
