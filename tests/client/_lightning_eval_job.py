"""A tiny Lightning job that validates inside ``fit`` (every 8 training batches, ~3 s), the usual way.

    python _lightning_eval_job.py OUT [STOP_STEP]

Validation draws from torch's RNG (``torch.rand`` noise, and its loader's seed). With ``STOP_STEP``
the job SIGTERMs itself at the 5th validation batch after that global step (unless it resumed from
there), and prints ``validating <step>`` when each validation starts; ``$JOB_TERM_IN_STEP`` makes it
SIGTERM itself inside that step instead. A ``ReduceLROnPlateau`` steps at each epoch's end on the
last validation's metric, so a validation a resume skips changes the learning rate. The last line
is ``DIGEST <sha256>`` of the final weights and optimizer state.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch

from spotguard.integrations.lightning import SpotguardCallback

SAMPLES, BATCH = 48, 4


def data(seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(data(1), batch_size=BATCH, shuffle=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(data(2), batch_size=BATCH, shuffle=True)


class Module(pl.LightningModule):
    def __init__(self, stop_at: int | None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                       torch.nn.Linear(16, 1))
        self.stop_at = stop_at

    def on_train_start(self):
        self.start = self.global_step

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == int(os.environ.get("JOB_TERM_IN_STEP", "0")) and self.global_step >= self.start:
            os.kill(os.getpid(), signal.SIGTERM)  # inside that step: the stop comes at its end
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            print(f"validating {self.global_step}", flush=True)
        if batch_idx == 5 and self.global_step == self.stop_at and self.global_step > self.start:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.25)
        x, y = batch
        self.log("val", torch.nn.functional.mse_loss(self.net(x + 0.1 * torch.rand_like(x)), y))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val"}}


def main() -> None:
    out, stop_at = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None
    pl.seed_everything(0)
    module = Module(stop_at)
    callback = SpotguardCallback(os.path.join(out, "ckpt"), save_every=6, daemon=False, job_id="lightning-eval")
    trainer = pl.Trainer(max_steps=28, accelerator="cpu", deterministic=True, logger=False,
                         val_check_interval=8, num_sanity_val_steps=0, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, Data())
    callback.exit_if_stopped()
    h = hashlib.sha256()
    for t in list(module.state_dict().values()) + [v for s in trainer.optimizers[0].state.values()
                                                   for v in s.values() if torch.is_tensor(v)]:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    print("DIGEST", h.hexdigest(), flush=True)


if __name__ == "__main__":
    main()
