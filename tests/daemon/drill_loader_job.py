"""A README-style job over a *plain* torch ``DataLoader``, for ``spotguard drill``'s tests.

    python drill_loader_job.py --ckpt-dir DIR [--steps N] [--step-sleep S]

Everything else is done right (model, optimizer and scheduler in the checkpoint), but the loader is
torch's own: shuffled from the global RNG, two workers whose augmentation draws from torch, NumPy
and ``random``, and no position in the checkpoint. A resumed run restarts its epoch with other
batches, so it cannot end where an uninterrupted one does; the drill must say so.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from torch import nn

import spotguard


class Noisy(torch.utils.data.Dataset):
    """Fixed samples plus a random augmentation drawn in the worker that loads them."""

    def __init__(self, n: int = 512) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        scale = random.uniform(0.9, 1.1) + float(np.random.normal(0, 0.01))
        return self.x[i] * scale + 0.05 * torch.randn(8), self.x[i].sum(0, keepdim=True)


def seed_numpy(worker_id: int) -> None:
    np.random.seed(torch.initial_seed() % 2**32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # forkserver, as spotguard's warning advises on CPython 3.11.7: a worker forked from this process
    # can hang for ever before it starts (gh-112275; CI saw the reference run hang once), and numpy
    # seeded from torch's per-worker seed, as a careful README job does (a forkserver's workers do
    # not inherit the parent's numpy state). The resume still diverges: the shuffle restarts.
    loader = torch.utils.data.DataLoader(Noisy(), batch_size=16, shuffle=True, num_workers=2,
                                         multiprocessing_context="forkserver", worker_init_fn=seed_numpy)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    with spotguard.Run(args.ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                       save_every=10) as run:
        stream = None
        for _ in run.steps(args.steps):
            stream = stream or iter(loader)  # one epoch (32 batches) covers the run
            inputs, targets = next(stream)
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
