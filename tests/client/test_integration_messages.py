"""What the callbacks and the checkpoint exchange say, and when training ends (issue 19, items 4, 6, 7).

* a crashed peer is named as the cause of a failed checkpoint exchange, with the time really waited,
  and a hung one with the timeout (two real gloo ranks);
* with no daemon, "no daemon answered" is said once per process, not at every checkpoint;
* the Lightning callback finishes a normal fit without a warning;
* both callbacks let training go on under a notice whose deadline is far (``stop_lead``);
* a Hugging Face job relaunched after ``max_steps`` trains nothing and writes nothing;
* the Hugging Face callback stops at the step end right after the signal;
* ``Run`` counts the real steps of an optimizer Accelerate wraps (``AcceleratedOptimizer``).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_integrations import TinyModel, TinyModule, collate, dataset, quiet_guard, restore_signals  # noqa: F401

import spotguard
from spotguard import guard as guard_module
from spotguard.checkpoint.distributed import Coordinator
from spotguard.checkpoint.errors import CheckpointError

pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (extra: lightning)")
transformers = pytest.importorskip("transformers", reason="needs transformers (extra: hf)")

from spotguard.integrations.huggingface import SpotguardTrainerCallback  # noqa: E402
from spotguard.integrations.lightning import SpotguardCallback  # noqa: E402


# ---------------------------------------------------------------------- the checkpoint exchange


def _exchange(rank: int, init: str, peer: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    coordinator = Coordinator(dist.group.WORLD, timeout=3.0)
    coordinator.all_reduce([1])  # both ranks are connected
    if rank == 1:
        if peer == "hangs":
            time.sleep(6)
        os._exit(0)  # a crash: no teardown, the kernel closes its connections
    started = time.monotonic()
    try:
        coordinator.all_reduce([1])
    except CheckpointError as exc:
        out["message"], out["waited"] = str(exc), time.monotonic() - started
    os._exit(0)


@pytest.mark.parametrize("peer", ["crashes", "hangs"])
def test_a_failed_checkpoint_exchange_names_its_cause_and_the_time_it_waited(tmp_path, peer):
    with mp.Manager() as manager:
        shared = manager.dict()
        context = mp.start_processes(_exchange, args=(f"file://{tmp_path}/init", peer, shared), nprocs=2,
                                     join=False, start_method="spawn")
        while not context.join(timeout=30):
            pass
        out = dict(shared)
    message = out["message"]
    if peer == "crashes":
        assert out["waited"] < 2.5, out
        waited = float(re.search(r"failed after ([\d.]+) s", message).group(1))
        assert waited < 2.5 and "a peer rank is gone" in message and "within" not in message, message
    else:
        assert 2.5 < out["waited"] < 6, out
        assert message.startswith("checkpoint ranks did not agree within 3 s") and "stuck" in message, message


# ---------------------------------------------------------------------- no daemon


def test_no_daemon_is_said_once_per_process_not_at_every_checkpoint(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("SPOTGUARD_RUNTIME_DIR", str(tmp_path / "no-daemon"))
    monkeypatch.setattr(guard_module, "_UNANSWERED_SAID", False)
    caplog.set_level(logging.INFO, logger="spotguard")
    model = torch.nn.Linear(2, 1)
    for attempt in range(2):  # two runs in one process: still said once
        guard = spotguard.Guard(daemon=True, force_exit=False)
        with spotguard.Run(tmp_path / "ckpt", model=model, save_every=1, guard=guard, job_id="quiet") as run:
            for _ in run.steps(3 + 3 * attempt):
                pass
        guard.close()
    said = [r.getMessage() for r in caplog.records if r.name == "spotguard.guard"]
    assert len(said) == 1 and said[0].startswith("no daemon answered the commit of step 1"), said


# ---------------------------------------------------------------------- Lightning finishes quietly


def test_a_normal_lightning_finish_logs_no_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="spotguard")
    callback = SpotguardCallback(tmp_path, save_every=4, guard=quiet_guard())
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyModule(), torch.utils.data.DataLoader(dataset(), batch_size=8))
    assert [r.getMessage() for r in caplog.records] == []
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000000004", "step-0000000006"]


def test_lightning_far_deadline_lets_training_go_on(tmp_path, caplog):
    """``stop_lead`` in the Lightning callback: a SIGTERM whose deadline is an hour away is noted
    once and does not stop a 6-step fit (Lightning's own handler does not end it either)."""
    caplog.set_level(logging.WARNING, logger="spotguard")
    guard = quiet_guard(signal_deadlines={signal.SIGTERM: 3600.0})
    callback = SpotguardCallback(tmp_path, guard=guard)
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyModule(signal_at=2, signum=signal.SIGTERM), torch.utils.data.DataLoader(dataset(), batch_size=8))
    assert not callback.stopped and trainer.global_step == 6
    said = [r.getMessage() for r in caplog.records if r.name != "spotguard.guard"]  # the notice itself
    assert len(said) == 1 and "deadline in 3600 s; training goes on" in said[0], said


# ---------------------------------------------------------------------- Hugging Face


def hf_train(out, callback, max_steps=6, resume=None, **extra) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        str(out), max_steps=max_steps, per_device_train_batch_size=8, save_steps=4, use_cpu=True,
        report_to=[], logging_strategy="no", disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(TinyModel(), args, train_dataset=dataset(), data_collator=collate,
                                   callbacks=[callback, *extra.get("callbacks", [])])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_a_finished_hf_job_relaunched_trains_nothing(tmp_path):
    """6 steps of 8 batches an epoch: the relaunch resumes mid-epoch, where the Trainer would run a
    seventh step (and write checkpoint-7) before it looks at max_steps."""
    first = SpotguardTrainerCallback(guard=quiet_guard())
    done = hf_train(tmp_path, first)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    again = SpotguardTrainerCallback(guard=quiet_guard())
    relaunched = hf_train(tmp_path, again, resume=str(tmp_path / "checkpoint-6"))
    assert relaunched.state.global_step == 6 and not again.stopped
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert all(torch.equal(a, b) for a, b in zip(weights(done), weights(relaunched)))
    again.exit_if_stopped()  # exits nothing: the job is finished


class SignalAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_hf_stops_at_the_step_end_right_after_the_signal(tmp_path):
    callback = SpotguardTrainerCallback(guard=quiet_guard())
    trainer = hf_train(tmp_path, callback, max_steps=20, callbacks=[SignalAt(2)])
    assert callback.stopped and trainer.state.global_step == 3
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]


def test_hf_far_deadline_lets_training_go_on(tmp_path, caplog):
    """``stop_lead``: a SIGTERM whose deadline is an hour away does not stop a 20-step job."""
    caplog.set_level(logging.WARNING, logger="spotguard")
    guard = quiet_guard(signal_deadlines={signal.SIGTERM: 3600.0})
    callback = SpotguardTrainerCallback(guard=guard)
    trainer = hf_train(tmp_path, callback, max_steps=8, callbacks=[SignalAt(2)])
    assert not callback.stopped and trainer.state.global_step == 8
    said = [r.getMessage() for r in caplog.records if "training goes on" in r.getMessage()]
    assert len(said) == 1 and "deadline in 3600 s" in said[0], said
    guard.close()


# ---------------------------------------------------------------------- Accelerate


def test_run_counts_the_steps_of_an_accelerated_optimizer(tmp_path, request):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    request.addfinalizer(lambda: (AcceleratorState._reset_state(True), GradientState._reset_state()))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    run = spotguard.Run(tmp_path, model=model, optimizer=opt, guard=quiet_guard(), job_id="acc")
    x, y = dataset().tensors
    with run:
        for step in run.steps(10):
            for micro in range(2):  # two micro-batches drawn inside the step
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.mse_loss(model(x[micro::2]), y[micro::2]))
                    opt.step()
                    opt.zero_grad()
            if step == 4:
                break
    assert run._optimizer_steps == 5 and run.step == 5  # the step left by break stepped: counted
