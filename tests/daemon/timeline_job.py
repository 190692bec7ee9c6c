"""A small training job for the notice timeline tests: a real optimizer step per step, no periodic save.

    python timeline_job.py ROOT

It trains until a notice stops it (exit 75, after its emergency save), ``--step-sleep`` per step.
"""

from __future__ import annotations

import argparse
import time

import torch

from spotguard import Run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--step-sleep", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = Run(args.root, model=model, optimizer=optimizer, save_every=1_000_000, job_id="timeline")
    for step in run.steps(1_000_000):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
