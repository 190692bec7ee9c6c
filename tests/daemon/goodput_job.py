"""A tiny job for the goodput tests: commits every ``--save-every`` steps, ``--step-sleep`` per step.

    python goodput_job.py ROOT --total N --save-every K [--hold M --ready FILE]

With ``--hold M`` it stops at step M once the daemon acknowledged its progress report of step M (and
the commits before it), writes FILE and sleeps until the test kills it: the steps after the last
commit are then known to the daemon, deterministically.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from spotguard import Run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--total", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--hold", type=int)
    parser.add_argument("--ready", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Linear(2, 1)
    run = Run(args.root, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
              save_every=args.save_every, job_id="goodput-e2e")
    for step in run.steps(args.total):
        if step == args.hold:
            hold(run, step, args.ready)
        time.sleep(args.step_sleep)
    run.finish()


def hold(run: Run, step: int, ready: Path) -> None:
    run.checkpointer.wait()  # the commits before ``step`` were reported
    deadline = time.monotonic() + 30
    while run.guard.progress_acknowledged != step and time.monotonic() < deadline:
        time.sleep(0.01)
    ready.write_text(str(run.guard.progress_acknowledged))
    time.sleep(600)  # killed by the test


if __name__ == "__main__":
    main()
