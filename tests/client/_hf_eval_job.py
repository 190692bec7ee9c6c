"""A tiny Hugging Face ``Trainer`` job that evaluates inside ``train()`` (every 8 steps, ~1.2 s).

    python _hf_eval_job.py OUT [STOP_STEP]

The model draws from torch's RNG in training and in evaluation (dropout, ``torch.rand`` noise); an
evaluation's prediction steps are slow. With ``STOP_STEP`` the job SIGTERMs itself at the 5th
prediction step of the evaluation after that global step (unless it resumed from there). It prints
``evaluating <step>`` when an evaluation starts, and at the end ``DIGEST <sha256>`` of the final
weights and optimizer state. The callback talks to a daemon when one runs (``job_id`` ``hf-eval``).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import torch
import transformers

from spotguard.integrations.huggingface import SpotguardTrainerCallback, latest_checkpoint

SAMPLES, BATCH = 48, 4


def dataset(seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g),
                                          torch.randn(SAMPLES, 1, generator=g))


def collate(rows):
    return {"x": torch.stack([r[0] for r in rows]), "y": torch.stack([r[1] for r in rows])}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                       torch.nn.Linear(16, 1))

    def forward(self, x, y):
        if not self.training:
            time.sleep(0.1)  # a long evaluation
        return {"loss": torch.nn.functional.mse_loss(self.net(x + 0.1 * torch.rand_like(x)), y)}


class Stopper(transformers.TrainerCallback):
    def __init__(self, stop_at: int | None):
        self.stop_at, self.batch = stop_at, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.batch = 0

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.batch == 0:
            print(f"evaluating {state.global_step}", flush=True)
        self.batch += 1
        if self.batch == 5 and state.global_step == self.stop_at and state.global_step > self.start:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    out, stop_at = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None
    transformers.set_seed(0)
    args = transformers.TrainingArguments(
        out, max_steps=20, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH, save_steps=6,
        eval_strategy="steps", eval_steps=8, label_names=["y"], seed=0, use_cpu=True, report_to=[],
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, learning_rate=0.01)
    guard = SpotguardTrainerCallback(job_id="hf-eval")
    trainer = transformers.Trainer(Model(), args, train_dataset=dataset(1), eval_dataset=dataset(2),
                                   data_collator=collate, callbacks=[guard, Stopper(stop_at)])
    trainer.train(resume_from_checkpoint=latest_checkpoint(out, job_id="hf-eval"))
    guard.exit_if_stopped()
    h = hashlib.sha256()
    for t in list(trainer.model.state_dict().values()) + [v for s in trainer.optimizer.state.values()
                                                          for v in s.values() if torch.is_tensor(v)]:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    print("DIGEST", h.hexdigest(), flush=True)


if __name__ == "__main__":
    main()
