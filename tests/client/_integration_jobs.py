"""User-style training jobs for the framework callbacks, run as subprocesses by the tests.

``python _integration_jobs.py lightning|hf OUT``: a tiny dropout MLP trained from a shuffled loader
the framework's usual way (Lightning: ``DataLoader(shuffle=True)`` from a ``LightningDataModule``;
Hugging Face: the ``Trainer``'s own shuffled loader), checkpointed by the spotguard callback.
``$JOB_WORKERS`` and ``$JOB_ACCUMULATE`` set Lightning's loader workers
(persistent) and gradient accumulation. ``$JOB_STOPS`` (comma-separated steps) makes the job
SIGTERM itself at the first of those steps after the step it resumed from, so relaunching the identical command until it exits 0 stops it
at each of them. ``$JOB_DAEMON=1`` makes the callback talk to the daemon (job id ``integration``), and
``$JOB_KILL`` (a step) makes the job SIGKILL itself at that step once the daemon acknowledged its
progress. With ``$SPOTGUARD_STORAGE__URL`` the HF job's checkpoints are committed for the daemon's
upload and a fresh node restores from that store; under ``torchrun``, ``$JOB_SLOW_RNG_RANK`` makes
that rank's Trainer write its RNG state 1.5 s late (a slow disk), and ``$JOB_STEPS`` shortens the
run. The last line is ``DIGEST <sha256 of the final weights and optimizer state>``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import torch

STEPS, BATCH, SAMPLES = 30, 4, 48  # 12 batches an epoch: stops fall mid-epoch and on its end


def stops() -> list[int]:
    return [int(s) for s in os.environ.get("JOB_STOPS", "").split(",") if s]


def maybe_stop(step: int, start: int, guard=lambda: None, settle=lambda: None) -> None:
    """SIGTERM at a step of ``$JOB_STOPS``; SIGKILL at ``$JOB_KILL`` once ``guard()``'s daemon
    acknowledged the progress report of that step and ``settle()`` returned (a background save
    still in flight would otherwise make the resume step depend on the machine's load)."""
    if step > start and step in stops():
        os.kill(os.getpid(), signal.SIGTERM)
    if step > start and step == int(os.environ.get("JOB_KILL", "-1")):
        acknowledged(guard(), step)
        settle()
        os.kill(os.getpid(), signal.SIGKILL)


def acknowledged(guard, step: int) -> None:
    """Wait (at most 30 s) until the daemon acknowledged rank 0's progress report of ``step``."""
    deadline = time.monotonic() + 30
    while guard.progress_acknowledged != step and time.monotonic() < deadline:
        time.sleep(0.01)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g),
                                          torch.randn(SAMPLES, 1, generator=g))


def network() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                               torch.nn.Linear(16, 1))


def digest(*states) -> str:
    h = hashlib.sha256()
    for state in states:
        for key, value in sorted(_flatten(state)):
            h.update(key.encode())
            h.update(value.detach().contiguous().numpy().tobytes() if torch.is_tensor(value)
                     else repr(value).encode())
    return h.hexdigest()


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flatten(value, f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _flatten(value, f"{prefix}/{i}")
    else:
        yield prefix, obj


class HFModel(torch.nn.Module):
    """The network as the Hugging Face ``Trainer`` wants it: keyword inputs, a ``loss`` output."""

    def __init__(self):
        super().__init__()
        self.net = network()

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def collate(rows):
    return {"x": torch.stack([r[0] for r in rows]), "y": torch.stack([r[1] for r in rows])}


def lightning_job(out: str) -> None:
    import lightning.pytorch as pl

    from spotguard.integrations.lightning import SpotguardCallback

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            workers = int(os.environ.get("JOB_WORKERS", "0"))
            return torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True,
                                               num_workers=workers, persistent_workers=workers > 0)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()

        def on_train_start(self):
            self.start = self.global_step

        def training_step(self, batch, batch_idx):
            maybe_stop(self.global_step, self.start, lambda: callback.run.guard,
                       lambda: callback.run.checkpointer.wait(None))
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    pl.seed_everything(0)
    module = Module()
    daemon = os.environ.get("JOB_DAEMON") == "1"
    callback = SpotguardCallback(os.path.join(out, "ckpt"), save_every=4, daemon=daemon,
                                 job_id="integration" if daemon else "")
    accumulate = int(os.environ.get("JOB_ACCUMULATE", "1"))
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", deterministic=True, logger=False,
                         accumulate_grad_batches=accumulate,
                         callbacks=[callback], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, Data())
    callback.exit_if_stopped()
    print("DIGEST", digest(module.state_dict(), trainer.optimizers[0].state_dict()["state"]))


def hf_job(out: str) -> None:
    import transformers

    from spotguard.integrations.huggingface import SpotguardTrainerCallback, latest_checkpoint

    class Stopper(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = state.global_step

        def on_step_begin(self, args, state, control, **kwargs):
            maybe_stop(state.global_step, self.start, lambda: guard.guard)

    class Trainer(transformers.Trainer):
        def _save_rng_state(self, output_dir):
            if str(self.args.process_index) == os.environ.get("JOB_SLOW_RNG_RANK"):
                time.sleep(1.5)
            super()._save_rng_state(output_dir)

    transformers.set_seed(0)
    args = transformers.TrainingArguments(
        out, max_steps=int(os.environ.get("JOB_STEPS", STEPS)), per_device_train_batch_size=BATCH, save_steps=4, seed=0,
        use_cpu=True, report_to=[], logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, learning_rate=0.01)
    daemon = os.environ.get("JOB_DAEMON") == "1"
    guard = SpotguardTrainerCallback(daemon=daemon, job_id="integration" if daemon else "")
    trainer = Trainer(HFModel(), args, train_dataset=dataset(), data_collator=collate,
                                   callbacks=[guard, Stopper()])
    trainer.train(resume_from_checkpoint=latest_checkpoint(out, job_id="integration" if daemon else ""))
    guard.exit_if_stopped()
    print("DIGEST", digest(trainer.model.state_dict(), trainer.optimizer.state_dict()["state"]))


if __name__ == "__main__":
    {"lightning": lightning_job, "hf": hf_job}[sys.argv[1]](sys.argv[2])
