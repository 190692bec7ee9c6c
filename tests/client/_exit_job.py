"""A job that stops itself (SIGTERM at step 3) inside every kind of teardown a user writes.

``python _exit_job.py OUT [raise|catch]``: a ``spotguard.DataLoader`` with 2 workers (their pids go to
``OUT/workers``), ``with spotguard.Run(...)`` inside ``try/finally`` inside a user context manager,
an ``atexit`` handler, a file left open in a global and an unflushed ``print``. Each teardown step
appends its name to ``OUT/teardown``. With ``raise``, the ``finally`` block raises after the
stop; with ``catch``, ``main`` catches the ``SystemExit`` and the program ends normally (status 0).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys

import torch

import spotguard

OUT = sys.argv[1]
LEFT_OPEN = open(os.path.join(OUT, "left_open"), "w")  # noqa: SIM115 - left open on purpose


def note(name: str) -> None:
    with open(os.path.join(OUT, "teardown"), "a") as f:
        f.write(name + "\n")


def worker_init(_: int) -> None:
    with open(os.path.join(OUT, "workers"), "a") as f:
        f.write(f"{os.getpid()}\n")


@contextlib.contextmanager
def user_context():
    try:
        yield
    finally:
        note("context_exit")


def main() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(64.0).reshape(32, 2))
    loader = spotguard.DataLoader(data, batch_size=2, shuffle=True, num_workers=2, seed=0,
                                  worker_init_fn=worker_init)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    atexit.register(note, "atexit")
    LEFT_OPEN.write("written, never flushed nor closed\n")
    print("buffered, never flushed", end="")
    with user_context():
        try:
            with spotguard.Run(os.path.join(OUT, "ckpt"), model=model, optimizer=optimizer,
                               loader=loader, daemon=False) as run:
                global BATCHES  # an iterator alive until the interpreter exits: its workers too
                BATCHES = iter(loader)
                for step in run.steps(1000):
                    (x,) = next(BATCHES)
                    model(x).sum().backward()
                    optimizer.step()
                    if step == 3:
                        os.kill(os.getpid(), signal.SIGTERM)
        finally:
            note("finally")
            if sys.argv[2:] == ["raise"]:
                raise RuntimeError("a finally block that fails after the stop")


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        if sys.argv[2:] != ["catch"]:
            raise
