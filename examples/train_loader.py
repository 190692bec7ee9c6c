"""A training loop over a shuffled DataLoader with workers and random augmentation, preemption-safe.

    python examples/train_loader.py --steps 300 --ckpt-dir checkpoints --workers 2
    torchrun --nproc-per-node 2 examples/train_loader.py --steps 300 --ckpt-dir checkpoints --workers 2

Run the identical command again after an interruption (a kill included): it resumes from the newest
committed checkpoint and, on CPU, ends bit-identical to a run never interrupted. What makes the data
resumable is ``spotguard.DataLoader`` (torch's DataLoader, same arguments) given to ``Run(loader=)``:
it checkpoints the position, owns every seed the loader draws, and seeds each sample's augmentation
from its place in the run, so the number of workers and the resume point change nothing. Under
torchrun each rank draws its own share of every epoch: the loader shards by rank itself.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

import numpy as np
import torch
from torch import nn

import spotguard


class Noisy(torch.utils.data.Dataset):
    """Fixed samples plus a random augmentation (torch, NumPy and ``random``) drawn in the
    worker that loads them."""

    def __init__(self, n: int = 1000, features: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.sin(self.x[:, :1] * 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.05 * torch.randn(self.x.shape[1]) + torch.from_numpy(np.random.normal(0, 0.01, 1))
        return self.x[i] * random.uniform(0.9, 1.1) + noise.float(), self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ckpt-dir", default="checkpoints")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun
    if distributed:
        torch.distributed.init_process_group("gloo")
    dataset = Noisy()
    loader = spotguard.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=args.workers, seed=0)
    core = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
    model = nn.parallel.DistributedDataParallel(core) if distributed else core
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    run = spotguard.Run(args.ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                        loader=loader, save_every=args.save_every)

    def batches():  # endless, epoch after epoch; a generator, so it starts after the load
        while True:
            yield from loader
            loader.sampler.set_epoch(loader.sampler.epoch + 1)

    loss = None  # stays None when resumed at the last step: nothing is left to train
    with run:
        for step, (x, y) in zip(run.steps(args.steps), batches()):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
    shown = "-" if loss is None else f"{loss.item():.4f}"
    if not distributed or torch.distributed.get_rank() == 0:
        print(f"final step={run.step} epoch={loader.sampler.epoch} loss={shown}", flush=True)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
