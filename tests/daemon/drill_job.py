"""A small training job for ``spotguard drill``'s tests: correct, or broken on purpose.

    python drill_job.py --ckpt-dir DIR [--broken weights-only|restart|global-rng-loader]

The correct job: a shuffled DataLoader over ``spotguard.ResumableSampler`` (advanced each step),
dropout, AdamW, its loader drawing seeds from its own generator. The broken ones:

* ``weights-only``: checkpoints the model alone (the optimizer restarts from zero on resume);
* ``restart``: deletes its checkpoint directory at start ("clean output dir"), so every launch
  starts from step 0;
* ``global-rng-loader``: its DataLoader draws the iterator's base seed from the global torch RNG
  at a point of the stream that differs between a resumed and an uninterrupted run.
"""

from __future__ import annotations

import argparse
import shutil
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import spotguard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--broken", choices=("weights-only", "restart", "global-rng-loader"))
    args = parser.parse_args()
    if args.broken == "restart":
        shutil.rmtree(args.ckpt_dir, ignore_errors=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data_gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=data_gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = spotguard.ResumableSampler(len(data), seed=0)
    own = None if args.broken == "global-rng-loader" else torch.Generator().manual_seed(2)
    loader = DataLoader(data, batch_size=16, sampler=sampler, generator=own)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model} if args.broken == "weights-only" else \
        {"model": model, "optimizer": optimizer, "sampler": sampler}

    def batches():
        epoch = sampler.epoch
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    with spotguard.Run(args.ckpt_dir, state=state, save_every=10) as run:
        stream = None
        for _ in run.steps(args.steps):
            stream = stream or batches()  # the iterator is created after the checkpoint is loaded
            inputs, targets = next(stream)
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sampler.advance(len(inputs))
            time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
