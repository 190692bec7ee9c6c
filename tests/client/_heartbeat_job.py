"""A DDP job (torchrun, gloo, CPU) with an evaluation inside its loop body that calls
``run.heartbeat()`` per batch on every rank, with ``Run(agree_at_heartbeat=True)``.

    torchrun --nproc-per-node 2 _heartbeat_job.py OUT

12 steps, a save every 5, an evaluation of ``$JOB_EVAL_BATCHES`` batches (200) after every 4th step
(dropout on and ``torch.rand`` inputs: it draws from torch's RNG). Each rank prints ``eval <step>``
and ``evaluated <step>`` around it, writes ``OUT/pid.<rank>`` and ``OUT/exit.<rank>``; rank 0
prints ``DIGEST`` at the end. ``$JOB_SIGNAL_EVAL=S``: rank 1 alone sends itself SIGTERM at the 20th
batch of the evaluation after step S (once: ``OUT/signalled``). Lines are written whole (``say``); ``_torchrun_jobs.main`` runs it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _integration_jobs import BATCH, dataset, digest, network  # noqa: E402
from _torchrun_jobs import JOBS, RANK, endless, main, say, write  # noqa: E402

import spotguard  # noqa: E402

EVAL_BATCHES = int(os.environ.get("JOB_EVAL_BATCHES", "200"))
SIGNAL_EVAL = int(os.environ.get("JOB_SIGNAL_EVAL", "-1"))


def evaluate(run: spotguard.Run, model: torch.nn.Module, step: int, out: Path) -> None:
    say("eval", str(step))
    with torch.no_grad():  # dropout stays on: the evaluation draws from torch's RNG
        for batch in range(EVAL_BATCHES):
            model(torch.rand(16, 8))
            time.sleep(0.01)
            if RANK == 1 and step == SIGNAL_EVAL and batch == 20 and not (out / "signalled").exists():
                write(out / "signalled", str(step))
                os.kill(os.getpid(), signal.SIGTERM)
            run.heartbeat()
    say("evaluated", str(step))


def job(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(network())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = spotguard.DataLoader(dataset(), batch_size=BATCH, shuffle=True, seed=0)
    run = spotguard.Run(out / "ckpt", model=model, optimizer=opt, loader=loader, save_every=5, daemon=False,
                        job_id="heartbeat", agree_at_heartbeat=True)
    with run:
        for step, (x, y) in zip(run.steps(12), endless(loader)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if (step + 1) % 4 == 0:
                evaluate(run, model, step, out)
    say("DIGEST", digest(model.state_dict(), opt.state_dict()["state"]))


if __name__ == "__main__":
    JOBS["heartbeat"] = job  # _torchrun_jobs' main: pid and exit files, logging with the rank
    sys.argv.insert(1, "heartbeat")
    main()
