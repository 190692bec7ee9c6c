"""A DDP job for ``spotguard drill``'s tests, written as the README says, or with its DDP kept from
``Run`` or its data restarted on purpose.

    torchrun --nproc-per-node 3 drill_ddp_job.py --ckpt-dir DIR [--steps N] [--bare]
    torchrun --nproc-per-node 2 drill_ddp_job.py --ckpt-dir DIR --samples 40 --batch 2 [--own-epoch-counter]

Residual LayerNorm/Linear blocks under bf16 ``torch.autocast`` (each Linear's weight gradient is
ready before its bias, so DDP's rebuilt bucket layout is not the reversed parameter order), small
buckets, ``spotguard.DataLoader`` (a rank's share of a shuffled epoch), AdamW, gloo on CPU.
``--bare`` hands ``Run`` the bare module instead of the DDP (``model=ddp.module``): everything
stateful is checkpointed, but DDP's bucket layout is neither recorded nor restored, so a relaunched
DDP all-reduces its first steps in other buckets and with three ranks sums in another order.

The data comes through the README's endless ``batches()`` (by default one epoch covers the run).
``--samples 40 --batch 2`` makes an epoch 10 steps on 2 ranks (``spotguard drill --resize``'s test);
``--own-epoch-counter`` is the broken twin: its ``batches()`` sets the epoch from a counter of its own
that starts at 0, so a relaunch throws the restored data position away and starts over at epoch 0
(``set_epoch`` warns so).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.distributed as dist
from torch import nn

import spotguard

WIDTH = 24
BUCKET_MB = 4 * WIDTH * WIDTH / 2**20  # a few parameters a bucket: several buckets


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))
                                    for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--bare", action="store_true")
    parser.add_argument("--samples", type=int, default=3 * 8 * 200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--own-epoch-counter", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.samples, 8, generator=torch.Generator().manual_seed(1))
    loader = spotguard.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).tanh()),
                                  batch_size=args.batch, shuffle=True, seed=0)
    model = Residual()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    run = spotguard.Run(args.ckpt_dir, model=ddp.module if args.bare else ddp, optimizer=optimizer,
                        loader=loader, save_every=args.save_every)
    def batches():  # endless: epoch after epoch, resuming mid-epoch
        if args.own_epoch_counter:
            for epoch in itertools.count():
                loader.sampler.set_epoch(epoch)
                yield from loader
        while True:
            yield from loader
            loader.sampler.set_epoch(loader.sampler.epoch + 1)

    with run:
        for _, (inputs, targets) in zip(run.steps(args.steps), batches()):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(ddp(inputs).float(), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
