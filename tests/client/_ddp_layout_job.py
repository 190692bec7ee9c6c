"""Three-rank DDP jobs whose backward readies gradients out of parameter order, for test_ddp_layout.

``torchrun --nproc-per-node 3 _ddp_layout_job.py KIND OUT``, KIND one of:

* ``residual``: ``spotguard.Run(model=DDP(...))``, residual LayerNorm/Linear blocks under bf16
  ``torch.autocast`` (each Linear's weight gradient is ready before its bias);
* ``shared``: ``Run`` with a weight used twice (input and tied output) and blocks applied in the
  reverse of their definition order, trained with gradient accumulation through ``no_sync``;
* ``hf``: a Hugging Face ``Trainer`` (``ddp_find_unused_parameters=False``) with the residual model;
* ``lightning``: Lightning's ``strategy="ddp"`` with the residual model.

Every rank draws its batches from a generator seeded by (step, micro-batch, rank), inside the step.
``$JOB_STOP`` (a step): rank 0 SIGTERMs itself in that step, once, in the launch that started before
it (or at step 0); every rank stops at an agreed boundary after it with a save and exits 75. ``$JOB_STATIC=1`` builds
the DDP with ``static_graph=True``; ``$JOB_GUESS=1`` makes the resume ignore the recorded layout (as
for a checkpoint written before spotguard recorded it), so the old guess is used. Rank 0 prints
``START <the step the launch began at>``, ``DIGEST <sha256 of the final weights and optimizer
state>``, and for ``Run`` jobs ``LAYOUT <json>``
(the recorded layout) and ``GUESS <json>`` (the reversed-order guess).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from _integration_jobs import digest  # this directory is the script's: sys.path[0]

WIDTH, BATCH, STEPS, STEP_SECONDS = 24, 8, 14, 0.1
BUCKET_MB = 4 * WIDTH * WIDTH / 2**20  # a few parameters a bucket: several buckets


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(WIDTH), "fc": nn.Linear(WIDTH, WIDTH)})
                                    for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block["fc"](block["norm"](h))
        return self.head(h)


class Shared(nn.Module):
    """``tied`` is used first and last; the blocks run in the reverse of their definition order."""

    def __init__(self) -> None:
        super().__init__()
        self.tied = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.tied(x))
        for block in reversed(self.blocks):
            h = torch.tanh(block(h))
        return self.head(self.tied(h))


def say(*words: str) -> None:
    """Print one line in one write: the ranks share the output, and ``print`` writes the line and
    its end apart (unbuffered), so two ranks' lines could run together."""
    sys.stdout.write(" ".join(words) + "\n")
    sys.stdout.flush()


def batch(step: int, micro: int, rank: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(BATCH, features, generator=g), torch.randn(BATCH, 1, generator=g)


def maybe_stop(step: int, start: int) -> None:
    """Steps of :data:`STEP_SECONDS` (so the ranks' agreement on the stop comes within a few), and
    rank 0's SIGTERM in step ``$JOB_STOP`` of the launch that has not yet passed it."""
    time.sleep(STEP_SECONDS)
    if dist.get_rank() == 0 and (step > start or start == 0) and step == int(os.environ.get("JOB_STOP", "-1")):
        os.kill(os.getpid(), signal.SIGTERM)


def ignore_records_if_asked() -> None:
    if os.environ.get("JOB_GUESS") == "1":
        from spotguard import _ddp

        _ddp.Layouts.load_state_dict = lambda self, state: None  # as a checkpoint without the record


def run_job(kind: str, out: str) -> None:
    import spotguard
    from spotguard import _ddp

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Residual() if kind == "residual" else Shared()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB,
                                              static_graph=os.environ.get("JOB_STATIC") == "1")
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    accumulate = 1 if kind == "residual" else 2
    features = 8 if kind == "residual" else WIDTH
    run = spotguard.Run(os.path.join(out, "ckpt"), model=ddp, optimizer=opt, save_every=4, job_id="layout",
                        daemon=False)
    for step in run.steps(STEPS):
        maybe_stop(step, run.start_step)
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(step, micro, dist.get_rank(), features)
            sync = ddp.no_sync() if micro < accumulate - 1 else _nothing()
            with sync, torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "residual"):
                loss = nn.functional.mse_loss(ddp(x).float(), y)
            loss.backward()
        opt.step()
    run.finish()
    if dist.get_rank() == 0:
        print("LAYOUT", json.dumps(run.state[_ddp.ENTRY].state_dict()))
        print("GUESS", json.dumps(_ddp._guess(ddp)))
        print("START", run.start_step)
        say("DIGEST", digest(model.state_dict(), opt.state_dict()["state"]))
    dist.destroy_process_group()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def hf_job(out: str) -> None:
    import transformers

    from spotguard.integrations.huggingface import SpotguardTrainerCallback, latest_checkpoint

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Residual()

        def forward(self, x, y):
            return {"loss": nn.functional.mse_loss(self.net(x).float(), y)}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, index):
            g = torch.Generator().manual_seed(index)
            return {"x": torch.randn(8, generator=g), "y": torch.randn(1, generator=g)}

    class Stopper(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = state.global_step

        def on_step_begin(self, args, state, control, **kwargs):
            maybe_stop(state.global_step, self.start)

    transformers.set_seed(0)
    args = transformers.TrainingArguments(
        out, max_steps=STEPS, per_device_train_batch_size=BATCH, save_steps=4, seed=0, use_cpu=True,
        report_to=[], logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        learning_rate=0.01, bf16=True, ddp_find_unused_parameters=False, ddp_bucket_cap_mb=BUCKET_MB,
        ddp_backend="gloo")
    guard = SpotguardTrainerCallback(daemon=False, job_id="layout")
    stopper = Stopper()
    trainer = transformers.Trainer(Model(), args, train_dataset=Data(), callbacks=[guard, stopper])
    trainer.train(resume_from_checkpoint=latest_checkpoint(out))
    guard.exit_if_stopped()
    if trainer.args.process_index == 0:
        print("START", stopper.start)
        say("DIGEST", digest(trainer.model.state_dict(), trainer.optimizer.state_dict()["state"]))


def lightning_job(out: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from spotguard.integrations.lightning import SpotguardCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Residual()

        def on_train_start(self):
            self.start = self.global_step

        def training_step(self, batch, batch_idx):
            maybe_stop(self.global_step, self.start)
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(240, 8, generator=g), torch.randn(240, 1, generator=g))
    pl.seed_everything(0)
    module = Module()
    callback = SpotguardCallback(os.path.join(out, "ckpt"), save_every=4, daemon=False, job_id="layout")
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=3, precision="bf16-mixed",
                         strategy=DDPStrategy(process_group_backend="gloo", bucket_cap_mb=BUCKET_MB),
                         logger=False, callbacks=[callback], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True))
    callback.exit_if_stopped()
    if trainer.global_rank == 0:
        print("START", module.start)
        say("DIGEST", digest(module.state_dict(), trainer.optimizers[0].state_dict()["state"]))


if __name__ == "__main__":
    torch.set_num_threads(1)
    ignore_records_if_asked()
    kind, out = sys.argv[1], sys.argv[2]
    {"hf": hf_job, "lightning": lightning_job}.get(kind, lambda o: run_job(kind, o))(out)
