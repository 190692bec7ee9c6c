"""A data-parallel job for several nodes, written the README way (launched by torchrun on each node).

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        _multinode_job.py --ckpt-dir DIR --steps 60 [--save-every 10] [--step-sleep 0.05] [--width 32]

DDP over gloo, a shuffled ``spotguard.DataLoader`` (sharded by rank) with a random augmentation
from torch, NumPy and ``random``, dropout, AdamW and a warm-up + cosine ``LambdaLR``. Each rank
talks to its own node's daemon (``SPOTGUARD_RUNTIME_DIR``). The library records what happened
(``$SPOTGUARD_RECORD``): stops, commits, the final state digest.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import spotguard

FEATURES, ITEMS, BATCH = 8, 64, 4


class Augmented(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(ITEMS, FEATURES, generator=g), torch.randn(ITEMS, 1, generator=g)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int):
        noise = 0.1 * torch.randn(FEATURES) + float(np.random.normal(0, 0.1)) + random.gauss(0, 0.1)
        return self.x[i] + noise, self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--peer-timeout", type=float, default=600.0)
    p.add_argument("--width", type=int, default=32, help="hidden units (a larger checkpoint)")
    p.add_argument("--keep", type=int, default=3, help="local checkpoints kept per node")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    loader = spotguard.DataLoader(Augmented(), batch_size=BATCH, shuffle=True, seed=0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(FEATURES, args.width), nn.GELU(), nn.Dropout(0.2), nn.Linear(args.width, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    run = spotguard.Run(args.ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                        save_every=args.save_every, peer_timeout=args.peer_timeout, keep=args.keep)

    def batches():
        while True:
            yield from loader
            loader.sampler.set_epoch(loader.sampler.epoch + 1)

    with run:
        for step, (x, y) in zip(run.steps(args.steps), batches()):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()  # DDP all-reduces the gradients
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
    # One write for the line: ranks share the agent's pipe, and an unbuffered print() writes twice.
    os.write(1, f"rank={dist.get_rank()} final step={run.step}\n".encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
