"""A DDP job for two "nodes" that each give their own checkpoint root (node-local mode).

    torchrun --nnodes 2 --node-rank K --nproc-per-node 1 --master-addr 127.0.0.1 --master-port P \\
        _node_local_job.py --ckpt-dir DIR_OF_NODE_K --steps 12 [--stop-at 6]

``--stop-at`` leaves the loop with ``break`` after that step (the final checkpoint names it; the
same command without it continues). Prints ``rank=R final step=S digest=D``: the state digest of the
last commit, which equal final states share.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import spotguard


def main() -> None:
    p = argparse.ArgumentParser()
    for flag, kind, default in (("--ckpt-dir", str, None), ("--steps", int, 12), ("--stop-at", int, 0)):
        p.add_argument(flag, type=kind, default=default, required=default is None)
    args = p.parse_args()
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = spotguard.DataLoader(data, batch_size=4, shuffle=True, seed=0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run = spotguard.Run(args.ckpt_dir, model=model, optimizer=optimizer, loader=loader, save_every=4)

    with run:
        pending = iter(loader)
        for step in run.steps(args.steps):
            batch = next(pending, None)
            if batch is None:  # a new epoch, its own order
                loader.sampler.set_epoch(loader.sampler.epoch + 1)
                pending = iter(loader)
                batch = next(pending)
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
            optimizer.step()
            if step + 1 == args.stop_at:
                break
    last = run.checkpointer.latest()
    print(f"rank={dist.get_rank()} final step={last.step} digest={last.digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
