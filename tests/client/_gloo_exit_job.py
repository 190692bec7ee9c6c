"""A torchrun job that ends right after other code's gloo ``all_gather``s, as a Hugging Face
``Trainer`` does (``store_flos``: ``distributed_broadcast_scalars``): ``python _gloo_exit_job.py OUT``.

``spotguard.Run`` agrees the job id across the ranks (its first collective) and trains two steps;
then 50 ``all_gather``s of fresh tensors, the last one right before the interpreter exits. No
``destroy_process_group``: most scripts do not call it. Without spotguard's exit settle, a gloo
worker dropped the last gather's tensors after the interpreter began finalising, and the rank
aborted ("terminate called without an active exception") in 12 of 20 two-rank launches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import spotguard


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with spotguard.Run(out / "ckpt", model=model, optimizer=opt, save_every=1000) as run:
        for _ in run.steps(2):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    sys.stdout.write(f"rank {dist.get_rank()} trained\n")  # one write of the whole line: ranks share
    sys.stdout.flush()  # the pipe, and print() writes the newline apart (CI saw two lines run together)
    for i in range(50):  # as the HF Trainer's store_flos: gather, concatenate, drop
        scalar = torch.tensor([float(i)])
        gathered = [scalar.clone() for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, scalar)
        torch.cat(gathered).sum().item()


if __name__ == "__main__":
    main()
