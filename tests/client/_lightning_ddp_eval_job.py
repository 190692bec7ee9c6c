"""A Lightning DDP job (torchrun, gloo, CPU) that validates inside ``fit``, the usual way, for
``test_ddp_eval_notice``.

    torchrun --nproc-per-node 2 _lightning_ddp_eval_job.py OUT

``Trainer(strategy="ddp", max_steps=8, val_check_interval=4)``: 6 training batches an epoch per
rank, a validation after step 4 (20 batches per rank of 0.1 s, ``torch.rand`` noise: it
draws from torch's RNG), Lightning's sanity check first, a spotguard save every 5 steps. Each rank
prints ``validating <step>`` and ``validated <step>`` around a validation, writes ``OUT/pid.<rank>``
and ``OUT/exit.<rank>``; rank 0 prints ``DIGEST`` at the end. ``$JOB_SIGNAL_EVAL=S``: rank 1 alone
sends itself SIGTERM at the 5th batch of the validation after step S (once: ``OUT/signalled``).
Lines are written whole (``say``); ``_torchrun_jobs.main`` runs it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _integration_jobs import BATCH, dataset, digest, network  # noqa: E402
from _torchrun_jobs import JOBS, RANK, main, say, write  # noqa: E402

SIGNAL_EVAL = int(os.environ.get("JOB_SIGNAL_EVAL", "-1"))


def job(out: Path) -> None:
    import lightning.pytorch as pl

    from spotguard.integrations.lightning import SpotguardCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

        def loss(self, x, y):
            return torch.nn.functional.mse_loss(self.net(x), y)

        def training_step(self, batch, batch_idx):
            return self.loss(*batch)

        def validation_step(self, batch, batch_idx):
            step = self.global_step
            if batch_idx == 0 and not self.trainer.sanity_checking:
                say("validating", str(step))
            if RANK == 1 and step == SIGNAL_EVAL and batch_idx == 5 and not (out / "signalled").exists():
                write(out / "signalled", str(step))
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            x, y = batch
            self.log("val", self.loss(x + 0.1 * torch.rand_like(x), y), sync_dist=True)

        def on_validation_end(self):
            if not self.trainer.sanity_checking:
                say("validated", str(self.global_step))

    pl.seed_everything(0)
    module = Module()
    callback = SpotguardCallback(out / "ckpt", save_every=5, daemon=False, job_id="lightning-ddp-eval")
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", strategy="ddp", val_check_interval=4,
                         devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), deterministic=True,
                         logger=False, callbacks=[callback], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    g = torch.Generator().manual_seed(2)
    val = torch.utils.data.TensorDataset(torch.randn(80, 8, generator=g), torch.randn(80, 1, generator=g))
    trainer.fit(module, torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True),
                torch.utils.data.DataLoader(val, batch_size=2))
    callback.exit_if_stopped()
    if RANK == 0:
        say("DIGEST", digest(module.state_dict(), trainer.optimizers[0].state_dict()["state"]))


if __name__ == "__main__":
    JOBS["lightning-eval"] = job  # _torchrun_jobs' main: pid and exit files, logging with the rank
    sys.argv.insert(1, "lightning-eval")
    main()
