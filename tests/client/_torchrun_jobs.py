"""User-style DDP jobs for ``torchrun`` (gloo, CPU), run by ``test_torchrun_stop.py``.

``torchrun --nproc-per-node N _torchrun_jobs.py KIND OUT``, KIND one of:

* ``run``: ``spotguard.Run`` over ``DDP(model)`` with a shuffled ``spotguard.DataLoader``;
* ``loaders``: the same, each step on a batch of a ``spotguard.DataLoader`` and one of a plain torch
  ``DataLoader`` (:func:`loaders_job`);
* ``accelerate``: an Accelerate custom loop, ``accelerator.prepare(model, opt, sched)``, then
  ``spotguard.Run(..., optimizer=opt)`` as the README says;
* ``lightning``: ``Trainer(strategy="ddp")`` with ``DataLoader(shuffle=True)`` and the callback;
* ``hf``: the ``Trainer``'s own shuffled loader with the callback.

Every job: the dropout MLP and data of ``_integration_jobs.py``, ``$JOB_STEPS`` steps (24) of at
least ``$JOB_STEP_SLEEP`` seconds (0.05, so that a signal lands mid-run), a save every 4 steps.
``$JOB_AUTOCAST=1`` runs the forward under bf16 autocast (each framework's own switch: Lightning's
``precision="bf16-mixed"``, the Trainer's ``bf16=True``, Accelerate's ``mixed_precision="bf16"``);
``$JOB_ACCUM=2`` accumulates gradients over two micro-batches a step (``run.steps()`` and the
Accelerate loop draw them inside the step, under DDP's ``no_sync`` for all but the last; Lightning's
``accumulate_grad_batches``, the Trainer's ``gradient_accumulation_steps``). ``$JOB_WORKERS``: the
loaders' worker processes (0 by default; Lightning's and the Trainer's loaders too).
``$JOB_VALIDATE=K``: Lightning and the Trainer also validate every K steps, on 2 batches of a
validation loader with the same workers (a plain ``DataLoader`` Lightning is given, the Trainer's
own evaluation loader).
Each rank writes ``OUT/pid.<rank>`` at start and ``OUT/exit.<rank>`` (its exit status) at the
end; rank 0 writes ``OUT/progress`` (the steps done) after each step, adds a line to ``OUT/starts``
with the steps done at its first step end (more than one step in a launch that resumed), and prints ``DIGEST`` (the
final weights and optimizer state) when training ended normally; ``$JOB_SIGNAL_AT`` and
``$JOB_SIGNAL_RANK`` make one rank SIGTERM itself once (see :func:`step_done`). ``$JOB_DAEMON=1``: the job talks
to the daemon (its job id is ``torchrun`` either way). Log lines carry ``[rank N]``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

# torchrun runs the script with its folder first on sys.path; nothing here runs at import, so a
# spotguard.DataLoader's workers start from a forkserver (spotguard._fork), as in a real job
from _integration_jobs import BATCH, HFModel, collate, dataset, digest, network  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
STEPS = int(os.environ.get("JOB_STEPS", "24"))
SLEEP = float(os.environ.get("JOB_STEP_SLEEP", "0.05"))
DAEMON = os.environ.get("JOB_DAEMON") == "1"
AUTOCAST = os.environ.get("JOB_AUTOCAST") == "1"
ACCUM = int(os.environ.get("JOB_ACCUM", "1"))
WORKERS = int(os.environ.get("JOB_WORKERS", "0"))
VALIDATE = int(os.environ.get("JOB_VALIDATE", "0"))
JOB_ID = "torchrun"
_started: list[int] = []


def say(*words: str) -> None:
    """Print one line in one write: the ranks share the output, and ``print`` writes the line and
    its end apart (unbuffered), so two ranks' lines could run together."""
    sys.stdout.write(" ".join(words) + "\n")
    sys.stdout.flush()


def write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def step_done(out: Path, step: int) -> None:
    """Rank 0 notes the steps done; every rank takes at least SLEEP seconds a step. With
    ``$JOB_SIGNAL_AT=S`` and ``$JOB_SIGNAL_RANK=R``, rank R sends itself SIGTERM once S steps are
    done (in a resumed run only past the step it resumed from)."""
    if RANK == 0:
        if not _started:  # before the progress: a test that saw the progress finds the start line
            _started.append(step)
            with open(out / "starts", "a") as starts:
                starts.write(f"{step}\n")
        write(out / "progress", str(step))
    if str(RANK) == os.environ.get("JOB_SIGNAL_RANK") and step == int(os.environ.get("JOB_SIGNAL_AT", "-1")) \
            and not (out / "signalled").exists():
        write(out / "signalled", str(step))
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(SLEEP)


def endless(loader):
    while True:
        yield from loader
        loader.sampler.set_epoch(loader.sampler.epoch + 1)


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST)


def accumulate(model, batches, no_sync, backward=lambda loss: loss.backward()) -> None:
    """One step's backward: ``ACCUM`` micro-batches drawn here, inside the step, all but the last
    under ``no_sync()`` (DDP all-reduces once a step, as users write it)."""
    for micro in range(ACCUM):
        x, y = next(batches)
        with no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
            with autocast():
                loss = torch.nn.functional.mse_loss(model(x), y) / ACCUM
            backward(loss)


def run_job(out: Path) -> None:
    import torch.distributed as dist

    import spotguard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(network())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = spotguard.DataLoader(dataset(), batch_size=BATCH, shuffle=True, seed=0)
    run = spotguard.Run(out / "ckpt", model=model, optimizer=opt, loader=loader, save_every=4,
                        daemon=DAEMON, job_id=JOB_ID)
    batches = endless(loader)
    with run:
        for step in run.steps(STEPS):
            opt.zero_grad()
            accumulate(model, batches, model.no_sync)
            opt.step()
            step_done(out, step + 1)
    say("DIGEST", digest(model.state_dict(), opt.state_dict()["state"]))


def loaders_job(out: Path) -> None:
    """Each step trains on one batch of a ``spotguard.DataLoader`` and one of a plain torch
    ``DataLoader`` over a ``ResumableSampler`` (nothing of spotguard's on it: its forked workers
    outlive SIGTERM because the Run's Guard is live, its iterators' seeds from a generator of its
    own), both with
    ``$JOB_WORKERS`` workers (not persistent: they start again every epoch)."""
    import torch.distributed as dist

    import spotguard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(network())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ours = spotguard.DataLoader(dataset(), batch_size=BATCH, shuffle=True, seed=0, num_workers=WORKERS)
    sampler = spotguard.ResumableSampler(dataset(), shuffle=True, seed=1)
    plain = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                                        generator=torch.Generator())
    run = spotguard.Run(out / "ckpt", model=model, optimizer=opt, loader=ours, sampler=sampler, save_every=4,
                        daemon=DAEMON, job_id=JOB_ID)
    a, b = endless(ours), endless(plain)
    with run:
        for step in run.steps(STEPS):
            opt.zero_grad()
            (x1, y1), (x2, y2) = next(a), next(b)
            with autocast():
                loss = torch.nn.functional.mse_loss(model(torch.cat([x1, x2])), torch.cat([y1, y2]))
            loss.backward()
            opt.step()
            sampler.advance(len(x2))
            step_done(out, step + 1)
    say("DIGEST", digest(model.state_dict(), opt.state_dict()["state"]))


def accelerate_job(out: Path) -> None:
    from accelerate import Accelerator

    import spotguard

    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if AUTOCAST else "no")
    torch.manual_seed(0)
    model = network()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    loader = spotguard.DataLoader(dataset(), batch_size=BATCH, shuffle=True, seed=0)
    run = spotguard.Run(out / "ckpt", model=model, optimizer=opt, scheduler=sched, loader=loader,
                        save_every=4, daemon=DAEMON, job_id=JOB_ID)
    batches = endless(loader)
    with run:
        for step in run.steps(STEPS):
            accumulate(model, batches, lambda: accelerator.no_sync(model), accelerator.backward)
            opt.step()
            sched.step()
            opt.zero_grad()
            step_done(out, step + 1)
    say("DIGEST", digest(model.state_dict(), opt.state_dict()["state"]))


def lightning_job(out: Path) -> None:
    import lightning.pytorch as pl

    from spotguard.integrations.lightning import SpotguardCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            step_done(out, self.global_step)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    pl.seed_everything(0)
    module = Module()
    callback = SpotguardCallback(out / "ckpt", save_every=4, daemon=DAEMON, job_id=JOB_ID)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", strategy="ddp", accumulate_grad_batches=ACCUM,
                         precision="bf16-mixed" if AUTOCAST else "32-true",
                         devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), deterministic=True,
                         logger=False, callbacks=[callback], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         **({"val_check_interval": VALIDATE, "limit_val_batches": 2, "num_sanity_val_steps": 0,
                             "check_val_every_n_epoch": None} if VALIDATE else {}))
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    validation = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, num_workers=WORKERS)
    trainer.fit(module, loader, validation if VALIDATE else None)
    callback.exit_if_stopped()
    say("DIGEST", digest(module.state_dict(), trainer.optimizers[0].state_dict()["state"]))


def hf_job(out: Path) -> None:
    import transformers

    from spotguard.integrations.huggingface import SpotguardTrainerCallback, latest_checkpoint

    class Progress(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_done(out, state.global_step)

    transformers.set_seed(0)
    args = transformers.TrainingArguments(
        str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, save_steps=4, seed=0,
        use_cpu=True, report_to=[], logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=WORKERS, learning_rate=0.01, bf16=AUTOCAST, gradient_accumulation_steps=ACCUM,
        **({"eval_strategy": "steps", "eval_steps": VALIDATE, "per_device_eval_batch_size": BATCH} if VALIDATE else {}))
    guard = SpotguardTrainerCallback(daemon=DAEMON, job_id=JOB_ID)
    evaluate = torch.utils.data.Subset(dataset(), range(2 * BATCH * int(os.environ.get("WORLD_SIZE", "1"))))
    trainer = transformers.Trainer(HFModel(), args, train_dataset=dataset(), data_collator=collate,
                                   eval_dataset=evaluate if VALIDATE else None, callbacks=[guard, Progress()])
    trainer.train(resume_from_checkpoint=latest_checkpoint(out, job_id=JOB_ID))
    guard.exit_if_stopped()
    say("DIGEST", digest(trainer.model.state_dict(), trainer.optimizer.state_dict()["state"]))


JOBS = {"run": run_job, "loaders": loaders_job, "accelerate": accelerate_job, "lightning": lightning_job,
        "hf": hf_job}


def main() -> None:
    kind, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format=f"[rank {RANK}] %(name)s: %(message)s")
    for noisy in ("lightning", "transformers", "accelerate", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    torch.set_num_threads(1)
    write(out / f"pid.{RANK}", str(os.getpid()))
    code: object = 1
    try:
        JOBS[kind](out)
        code = 0
        if torch.distributed.is_initialized():  # as PyTorch asks; not enough against the abort at
            torch.distributed.destroy_process_group()  # exit after the Trainer's last all_gather
            # (the DDP model still holds the group): spotguard's exit settle is (spotguard._gloo_release)
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code
        raise
    finally:
        write(out / f"exit.{RANK}", str(code))


if __name__ == "__main__":
    main()
