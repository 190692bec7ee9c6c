"""A plain PyTorch training loop made preemption-safe with spotguard.

    python examples/train_plain.py --steps 300 --ckpt-dir checkpoints
    torchrun --nproc-per-node 2 examples/train_plain.py --steps 300 --ckpt-dir checkpoints

Run the identical command again after an interruption: it resumes from the newest committed
checkpoint and, on CPU, ends bit-identical to a run that was never interrupted (the final digest
line shows it). A SIGTERM, a SIGUSR1 or a daemon notice makes it save (when the save fits before
the deadline) and exit with status 75 (``EXIT_PREEMPTED``): "run me again".

Data are synthetic and a pure function of (seed, step, rank), so no data loader state is needed;
dropout draws from torch's global generator, whose state spotguard checkpoints too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
from torch import nn

import spotguard

FEATURES, HIDDEN, BATCH = 32, 64, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    parser.add_argument("--ckpt-dir", default="checkpoints", help="checkpoint root directory")
    parser.add_argument("--save-every", type=int, default=None,
                        help="checkpoint every N steps (default: Young/Daly cadence)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--signal-deadline", type=float, default=30.0,
                        help="seconds between SIGTERM and the kill (Kubernetes: 30, RunPod: 5)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def say(line: str) -> None:
    """Print ``line`` in one write: torchrun runs the ranks unbuffered (``python -u``), where
    print() writes the text and its newline apart and two ranks' lines interleave."""
    os.write(1, f"{line}\n".encode())


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` on ``rank``: deterministic, independent of any global RNG."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    y = torch.sin(x[:, :1] * 3) + 0.5 * x[:, 1:2] * x[:, 2:3]
    return x, y


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the model's and the optimizer's state, to compare runs bit for bit."""
    sha = hashlib.sha256()

    def feed(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            sha.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                sha.update(str(key).encode())
                feed(obj[key])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                feed(item)
        else:
            sha.update(repr(obj).encode())

    feed(model.state_dict())
    feed(optimizer.state_dict())
    return sha.hexdigest()


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():  # CUDA kernels may race; this job's CPU ops are deterministic
        torch.use_deterministic_algorithms(True)  # (it imports torch._inductor: seconds a start)
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    torch.manual_seed(args.seed)
    core = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Dropout(0.1), nn.Linear(HIDDEN, 1))
    model = nn.parallel.DistributedDataParallel(core) if distributed else core
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.steps, 1))

    def on_commit(info) -> None:
        if rank == 0:
            say(f"checkpoint step={info.step} path={info.path}")

    run = spotguard.Run(args.ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler,
              save_every=args.save_every, on_commit=on_commit,
              signal_deadlines={signal.SIGTERM: args.signal_deadline, signal.SIGUSR1: None})
    try:
        with run:
            for step in run.steps(args.steps):
                if step == run.start_step:
                    say(f"rank={rank} pid={os.getpid()} start step={step}")
                x, y = batch(args.seed, step, rank)
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
    except SystemExit as stop:  # raised by run.steps() after a clean stop: status 75
        say(f"rank={rank} stopped step={run.step} status={stop.code}")
        raise
    if rank == 0:
        say(f"final step={run.step} digest={digest(core, optimizer)}")
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
