"""User-style training jobs for the framework callbacks, run as subprocesses by the tests.

``python _integration_jobs.py lightning|hf OUT``: a tiny dropout MLP trained from a shuffled loader
the framework's usual way (Lightning: ``DataLoader(shuffle=True)`` from a ``LightningDataModule``;
Hugging Face: the ``Trainer``'s own shuffled loader), checkpointed by the spotguard callback.
``$JOB_WORKERS`` and ``$JOB_ACCUMULATE`` set Lightning's loader workers
(persistent) and gradient accumulation. ``$JOB_STOPS`` (comma-separated steps) makes the job
SIGTERM itself at the first of those steps after the step it resumed from, so relaunching the identical command until it exits 0 stops it
at each of them. ``$JOB_DAEMON=1`` makes the callback talk to the daemon (job id ``integration``), and
``$JOB_KILL`` (a step) makes the job SIGKILL itself at that step once the daemon acknowledged its
progress. Lightning: ``$JOB_CRASH`` (comma-separated steps) makes it SIGKILL itself once at each of
them, its saves settled; ``$JOB_VALIDATE=1`` adds a validation every 8 batches (across epochs), a
``ReduceLROnPlateau`` stepped each epoch on its metric and ``EarlyStopping`` on it
(``$JOB_VALIDATION_SLEEP``: seconds each validation batch sleeps); the digest then
also covers the scheduler's and the callbacks' states. The Lightning digest covers the fit loop's
epoch counters and how many epoch starts and validations the job's hooks saw; ``EPOCH_ENDS`` is
printed apart. With ``$SPOTGUARD_STORAGE__URL`` the HF job's checkpoints are committed for the daemon's
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


def crash(step: int, start: int, out: str, settle) -> None:
    """SIGKILL once at each step of ``$JOB_CRASH`` (a marker file remembers it), saves settled."""
    crashes = [int(s) for s in os.environ.get("JOB_CRASH", "").split(",") if s]
    marker = os.path.join(out, f"crashed-{step}")
    if step > start and step in crashes and not os.path.exists(marker):
        settle()
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def lightning_job(out: str) -> None:
    import lightning.pytorch as pl

    from spotguard.integrations.lightning import SpotguardCallback

    validate = os.environ.get("JOB_VALIDATE") == "1"

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            workers = int(os.environ.get("JOB_WORKERS", "0"))
            return torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True,
                                               num_workers=workers, persistent_workers=workers > 0)

    class Validated(Data):
        def val_dataloader(self):
            return torch.utils.data.DataLoader(dataset(), batch_size=BATCH)

    class Hooks(pl.Callback):
        """Counts what a resume must not skip: epoch starts and ends, validations."""

        def __init__(self):
            self.seen = {"epoch_starts": 0, "epoch_ends": 0, "validations": 0}

        def on_train_epoch_start(self, trainer, module):
            self.seen["epoch_starts"] += 1

        def on_train_epoch_end(self, trainer, module):
            self.seen["epoch_ends"] += 1

        def on_validation_end(self, trainer, module):
            self.seen["validations"] += not trainer.sanity_checking

        def state_dict(self):
            return dict(self.seen)

        def load_state_dict(self, state):
            self.seen = dict(state)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()

        def on_train_start(self):
            self.start = self.global_step

        def training_step(self, batch, batch_idx):
            maybe_stop(self.global_step, self.start, lambda: callback.run.guard,
                       lambda: callback.run.checkpointer.wait(None))
            crash(self.global_step, self.start, out, lambda: callback.run.checkpointer.wait(None))
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train", loss, on_step=True, on_epoch=True)  # an epoch aggregate: never exact after a resume
            return loss

        def validation_step(self, batch, batch_idx):
            time.sleep(float(os.environ.get("JOB_VALIDATION_SLEEP", "0")))
            x, y = batch  # dropout and a draw of its own: the validation's RNG use changes nothing
            self.log("val", torch.nn.functional.mse_loss(self.net(x), y) + torch.rand(()))

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
            if not validate:
                return optimizer
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": plateau, "interval": "epoch", "monitor": "val"}}

    pl.seed_everything(0)
    module = Module()
    daemon = os.environ.get("JOB_DAEMON") == "1"
    callback = SpotguardCallback(os.path.join(out, "ckpt"), save_every=4, daemon=daemon,
                                 job_id="integration" if daemon else "")
    hooks = Hooks()
    more = {"val_check_interval": 8, "check_val_every_n_epoch": None} if validate else {}
    accumulate = int(os.environ.get("JOB_ACCUMULATE", "1"))
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", deterministic=True, logger=False,
                         accumulate_grad_batches=accumulate,
                         callbacks=[callback, hooks] + [pl.callbacks.EarlyStopping("val", patience=99)] * validate,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **more)
    trainer.fit(module, Validated() if validate else Data())
    callback.exit_if_stopped()
    saved = trainer._checkpoint_connector.dump_checkpoint()
    bookkeeping = {"hooks": hooks.seen, "epochs": trainer.fit_loop.epoch_progress.state_dict(),
                   "schedulers": saved.get("lr_schedulers", []),
                   "callbacks": {k: v for k, v in saved["callbacks"].items() if "EarlyStopping" in k}}
    print("BOOKKEEPING", bookkeeping)
    print("EPOCH_ENDS", hooks.seen.pop("epoch_ends"))  # a stop after an epoch's last batch skips one
    print("DIGEST", digest(module.state_dict(), trainer.optimizers[0].state_dict()["state"], bookkeeping))


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
