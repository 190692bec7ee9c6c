"""A DDP job (torchrun, gloo) whose rank 0 hangs on its own, for tests/client/test_local_hang.py.

    torchrun --nproc-per-node 2 tests/client/_hang_job.py OUT --hang loader|save|none
        [--peer-timeout S] [--stall S] [--steps N]

``--hang loader``: at step 3, rank 0's loader workers block in ``__getitem__`` (alive, producing
nothing); ``--hang save``: rank 0's checkpoint writes from step 4 on never return. Each worker
writes its pid to ``OUT/worker-<pid>``; rank 0 prints the start method its workers used.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import spotguard


class Items(torch.utils.data.Dataset):
    def __init__(self, out: str) -> None:
        self.out = out

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> torch.Tensor:
        mark = Path(self.out, f"worker-{os.getpid()}")
        if not mark.exists():
            mark.write_text(os.environ.get("RANK", "0"))
        if os.environ.get("RANK") == "0" and Path(self.out, "hang").exists():
            threading.Event().wait()  # alive, holding nothing, never returning
        return torch.full((4,), float(i))


def hang_saves() -> None:
    """Rank 0's checkpoint writes from now on never return (a stuck file system)."""
    from spotguard.checkpoint import commit

    def stuck(*args, **kwargs):
        threading.Event().wait()
    commit.write_part = stuck


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--hang", choices=["loader", "save", "none"], default="none")
    parser.add_argument("--peer-timeout", type=float, default=120.0)
    parser.add_argument("--stall", type=float, default=None)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    Path(args.out, f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = spotguard.DataLoader(Items(args.out), batch_size=4, shuffle=True, num_workers=2, seed=0,
                                  stall_timeout=args.stall)
    run = spotguard.Run(Path(args.out, "ckpt"), model=model, optimizer=opt, loader=loader, daemon=False,
                        peer_timeout=args.peer_timeout, save_every=2)
    batches = iter(loader)
    for step in run.steps(args.steps):
        if rank == 0 and step == 3 and args.hang != "none":
            hang_saves() if args.hang == "save" else Path(args.out, "hang").touch()
            print("hang begins", time.time(), flush=True)
        x = next(batches)
        if rank == 0 and step == run.start_step:
            context = loader.multiprocessing_context
            print("start method:", context.get_start_method() if context else "default", flush=True)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        time.sleep(0.01)
    run.finish()


if __name__ == "__main__":
    main()
