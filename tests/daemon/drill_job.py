"""A small training job for ``spotguard drill``'s tests: correct, or broken on purpose.

    python drill_job.py --ckpt-dir DIR [--steps N] [--save-every N (0: Run's default cadence)] [--noise]
                        [--broken weights-only|restart|global-rng-loader|no-optimizer|no-scheduler|no-loader]

The correct job: a shuffled DataLoader over ``spotguard.ResumableSampler`` (advanced each step),
dropout, AdamW with a warm-up ``LambdaLR``, its loader drawing seeds from its own generator.
``--noise`` makes it nondeterministic run to run the way atomics-based GPU reductions do: every
gradient gets 1e-7 relative noise from a generator seeded from OS entropy. The broken ones:

* ``weights-only``: checkpoints the model alone (optimizer, scheduler and data position restart);
* ``no-optimizer`` / ``no-scheduler`` / ``no-loader``: leaves that one object out of ``Run``;
* ``restart``: deletes its checkpoint directory at start ("clean output dir"), so every launch
  starts from step 0;
* ``global-rng-loader``: its DataLoader shuffles from the global torch RNG, with no position in
  the checkpoint (torch's own sampler).
"""

from __future__ import annotations

import argparse
import shutil
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import spotguard

BROKEN = ("weights-only", "restart", "global-rng-loader", "no-optimizer", "no-scheduler", "no-loader")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--noise", action="store_true")
    parser.add_argument("--broken", choices=BROKEN)
    args = parser.parse_args()
    if args.broken == "restart":
        shutil.rmtree(args.ckpt_dir, ignore_errors=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    noise = torch.Generator()
    noise.seed()  # OS entropy: differs in every process
    x = torch.randn(2048, 8, generator=torch.Generator().manual_seed(1))  # one epoch covers the run
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = spotguard.ResumableSampler(len(data), seed=0)
    if args.broken == "global-rng-loader":
        loader = DataLoader(data, batch_size=16, shuffle=True)
    else:
        loader = DataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    left_out = {"weights-only": ("optimizer", "scheduler", "sampler"), "no-optimizer": ("optimizer",),
                "no-scheduler": ("scheduler",), "no-loader": ("sampler",),
                "global-rng-loader": ("sampler",)}.get(args.broken, ())
    state = {name: obj for name, obj in {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                                          "sampler": sampler}.items() if name not in left_out}

    def batches():
        epoch = sampler.epoch
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    with spotguard.Run(args.ckpt_dir, state=state, save_every=args.save_every or None) as run:
        stream = None
        for _ in run.steps(args.steps):
            stream = stream or batches()  # the iterator is created after the checkpoint is loaded
            inputs, targets = next(stream)
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            if args.noise:
                for p in model.parameters():
                    p.grad.add_(p.grad * 1e-7 * torch.randn(p.grad.shape, generator=noise))
            optimizer.step()
            scheduler.step()
            if args.broken != "global-rng-loader":
                sampler.advance(len(inputs))
            time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
