"""A training job written the README way, with the data pipelines people use (one per flag set).

    python _resume_job.py --ckpt-dir DIR --steps 40 [--pipeline map|plain|stateful|stream]
        [--workers N] [--persistent] [--drop-last] [--no-set-epoch] [--iter before|lazy]
        [--accum K] [--amp] [--break-at STEP]

Map-style data carry a random augmentation drawn from torch, NumPy and Python's ``random`` inside
``__getitem__``; the model has dropout; AdamW, a warm-up + cosine ``LambdaLR`` built from a lambda,
gradient clipping, optional gradient accumulation and bf16 autocast with a saved ``GradScaler``.
The library records the final state digest in ``$SPOTGUARD_RECORD``; the job also prints it.
"""

from __future__ import annotations

import argparse
import math
import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import IterableDataset

import spotguard

FEATURES, ITEMS, BATCH = 8, 50, 8


class Augmented(torch.utils.data.Dataset):
    """Fixed base samples plus a random augmentation from all three generators."""

    def __init__(self, augment: bool = True) -> None:
        self.augment = augment
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(ITEMS, FEATURES, generator=g), torch.randn(ITEMS, 1, generator=g)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int):
        if not self.augment:
            return self.x[i], self.y[i]
        noise = 0.1 * torch.randn(FEATURES) + float(np.random.normal(0, 0.1)) + random.gauss(0, 0.1)
        return self.x[i] + noise, self.y[i]


class Stream(IterableDataset):
    """An endless stream that knows its position: item k is a function of k, plus augmentation."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        while True:
            k, self.position = self.position, self.position + 1
            g = torch.Generator().manual_seed(k)
            x = torch.randn(FEATURES, generator=g)
            yield x + 0.1 * torch.randn(FEATURES) + random.gauss(0, 0.1), x[:1] * 2

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--pipeline", default="map", choices=["map", "plain", "stateful", "stream"])
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--drop-last", action="store_true")
    p.add_argument("--no-set-epoch", action="store_true")
    p.add_argument("--iter", default="lazy", choices=["before", "lazy"])
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--break-at", type=int, default=None, help="leave the loop with break after this step")
    p.add_argument("--no-augment", action="store_true", help="samples without random augmentation")
    p.add_argument("--break-before-update", action="store_true",
                   help="--break-at leaves the step after drawing its batches, before the update")
    p.add_argument("--step-sleep", type=float, default=0.0)
    return p.parse_args()


def make_loader(args: argparse.Namespace):
    common = dict(batch_size=BATCH, num_workers=args.workers, drop_last=args.drop_last,
                  persistent_workers=args.persistent and args.workers > 0)
    if args.pipeline == "map":
        return spotguard.DataLoader(Augmented(), shuffle=True, **common)
    if args.pipeline == "stream":
        return spotguard.DataLoader(Stream(), batch_size=BATCH)
    if args.pipeline == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader(Augmented(not args.no_augment), shuffle=True, **common)
    sampler = spotguard.ResumableSampler(ITEMS, seed=0)  # "plain": the pattern that cannot be exact
    return torch.utils.data.DataLoader(Augmented(), sampler=sampler, **common)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    loader = make_loader(args)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 5
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
    data = {"loader": loader} if args.pipeline != "plain" else {"sampler": loader.sampler}
    run = spotguard.Run(args.ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                        state={"scaler": scaler}, save_every=args.save_every, keep=1000, daemon=False,
                        **data)

    def sampler():
        return getattr(loader, "sampler", None)

    def new_epoch():
        if not args.no_set_epoch and hasattr(sampler(), "set_epoch"):
            sampler().set_epoch(sampler().epoch + 1)

    def batches():  # README's way: a generator, so nothing starts before run.steps() loads
        while True:
            yield from loader
            new_epoch()

    it = iter(loader) if args.iter == "before" else batches()

    def next_batch():
        nonlocal it
        try:
            return next(it)
        except StopIteration:  # only the iterator made before the loop ends
            new_epoch()
            it = iter(loader)
            return next(it)

    loss = torch.zeros(())
    with run:
        for step in run.steps(args.steps):
            optimizer.zero_grad(set_to_none=True)
            for _ in range(args.accum):
                x, y = next_batch()
                if step == args.break_at and args.break_before_update:
                    break
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                    loss = nn.functional.mse_loss(model(x).float(), y) / args.accum
                scaler.scale(loss).backward()
                if args.pipeline == "plain":
                    loader.sampler.advance(len(x))
            if step == args.break_at and args.break_before_update:
                break
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if args.step_sleep:
                import time
                time.sleep(args.step_sleep)
            if step == args.break_at:
                break
    print(f"final step={run.step} loss={loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
