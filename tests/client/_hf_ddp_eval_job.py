"""A Hugging Face ``Trainer`` job under torchrun (2 ranks, gloo, CPU) that evaluates inside
``train()``, for ``test_ddp_eval_notice``.

    torchrun --nproc-per-node 2 _hf_ddp_eval_job.py OUT

``max_steps=8``, ``eval_steps=4``, ``save_steps=5``: an evaluation after step 4 (20 batches per rank
of 0.1 s, each drawing from torch's RNG in a callback). Each rank prints ``evaluating <step>`` and
``evaluated <step>`` around it, writes ``OUT/pid.<rank>`` and ``OUT/exit.<rank>``; rank 0 prints
``DIGEST``. ``$JOB_SIGNAL_EVAL=S``: rank 1 alone sends itself SIGTERM at the 5th prediction step of
the evaluation after step S (once: ``OUT/signalled``). ``_torchrun_jobs.main`` runs it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _integration_jobs import BATCH, HFModel, collate, dataset, digest  # noqa: E402
from _torchrun_jobs import JOBS, RANK, main, say, write  # noqa: E402

SIGNAL_EVAL = int(os.environ.get("JOB_SIGNAL_EVAL", "-1"))


def job(out: Path) -> None:
    import transformers

    from spotguard.integrations.huggingface import SpotguardTrainerCallback, latest_checkpoint

    class SlowEvaluation(transformers.TrainerCallback):
        batches = 0

        def on_prediction_step(self, args, state, control, **kwargs):
            if self.batches == 0:
                say("evaluating", str(state.global_step))
            self.batches += 1
            torch.rand(4)  # the evaluation draws from torch's RNG
            if RANK == 1 and state.global_step == SIGNAL_EVAL and self.batches == 5 \
                    and not (out / "signalled").exists():
                write(out / "signalled", str(state.global_step))
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)

        def on_evaluate(self, args, state, control, **kwargs):
            self.batches = 0
            say("evaluated", str(state.global_step))

    transformers.set_seed(0)
    args = transformers.TrainingArguments(
        str(out), max_steps=8, per_device_train_batch_size=BATCH, per_device_eval_batch_size=2,
        eval_strategy="steps", eval_steps=4, save_steps=5, seed=0, use_cpu=True, report_to=[],
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, learning_rate=0.01)
    g = torch.Generator().manual_seed(2)
    val = torch.utils.data.TensorDataset(torch.randn(80, 8, generator=g), torch.randn(80, 1, generator=g))
    guard = SpotguardTrainerCallback(daemon=False, job_id="hf-ddp-eval")
    trainer = transformers.Trainer(HFModel(), args, train_dataset=dataset(), eval_dataset=val,
                                   data_collator=collate, callbacks=[guard, SlowEvaluation()])
    trainer.train(resume_from_checkpoint=latest_checkpoint(out, job_id="hf-ddp-eval"))
    guard.exit_if_stopped()
    if RANK == 0:
        say("DIGEST", digest(trainer.model.state_dict(), trainer.optimizer.state_dict()["state"]))


if __name__ == "__main__":
    JOBS["hf-eval"] = job  # _torchrun_jobs' main: pid and exit files, logging with the rank
    sys.argv.insert(1, "hf-eval")
    main()
