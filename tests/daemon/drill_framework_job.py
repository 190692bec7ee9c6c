"""Tiny Lightning and Hugging Face Trainer jobs for ``spotguard drill``'s tests, as the README
writes them: a shuffled loader, dropout, AdamW, the framework's own checkpoints and loop.

    python drill_framework_job.py lightning|hf --out DIR [--steps N] [--step-sleep S]

Lightning: ``SpotguardCallback(DIR/ckpt, save_every=5)``; Hugging Face: ``SpotguardTrainerCallback``
with ``save_steps=5``, resuming from ``latest_checkpoint(DIR)``. Each exits 75 after a stop.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def data(samples: int = 4096) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=g)  # 4096: one epoch covers the run
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def network() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(16, 1))


def lightning(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl

    from spotguard.integrations.lightning import SpotguardCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()

        def training_step(self, batch, batch_idx):
            time.sleep(args.step_sleep)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    pl.seed_everything(0)
    callback = SpotguardCallback(os.path.join(args.out, "ckpt"), save_every=5)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", deterministic=True, logger=False,
                         callbacks=[callback, pl.callbacks.ModelCheckpoint(save_top_k=-1)],
                         enable_progress_bar=False, enable_model_summary=False)
    # 32 batches an epoch: Lightning's ModelCheckpoint (keeping every file) writes
    # epoch=0-step=32.ckpt in the reference run and, finding it there, epoch=0-step=32-v1.ckpt in
    # the drilled one; the final state, at step 60, names it
    trainer.fit(Module(), torch.utils.data.DataLoader(data(512), batch_size=16, shuffle=True))
    callback.exit_if_stopped()


def hf(args: argparse.Namespace) -> None:
    import transformers

    from spotguard.integrations.huggingface import SpotguardTrainerCallback, latest_checkpoint

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = network()

        def forward(self, x, y):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}

    class Pace(transformers.TrainerCallback):
        def on_step_end(self, *_, **__):
            time.sleep(args.step_sleep)

    transformers.set_seed(0)
    training = transformers.TrainingArguments(
        args.out, max_steps=args.steps, per_device_train_batch_size=16, save_steps=5, seed=0,
        use_cpu=True, report_to=[], logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, learning_rate=0.01)
    guard = SpotguardTrainerCallback()
    trainer = transformers.Trainer(
        Model(), training, train_dataset=data(), callbacks=[guard, Pace()],
        data_collator=lambda rows: {"x": torch.stack([r[0] for r in rows]),
                                    "y": torch.stack([r[1] for r in rows])})
    trainer.train(resume_from_checkpoint=latest_checkpoint(args.out))
    guard.exit_if_stopped()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("lightning", "hf"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    options = parser.parse_args()
    torch.set_num_threads(1)
    {"lightning": lightning, "hf": hf}[options.framework](options)
