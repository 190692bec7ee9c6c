"""The Lightning and Hugging Face callbacks, each driving a real Trainer on a tiny CPU model.

A notice is a real signal to this process (SIGUSR1: no deadline; SIGTERM: Lightning's own handler
runs too) or a real ZeroMQ event from the fake daemon; the guard is made without the forced-exit
watchdog so the test process survives the stop.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from _fake_daemon import FakeDaemon, make_notice, wait_for

from spotguard import EXIT_PREEMPTED, Guard

pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (extra: lightning)")
transformers = pytest.importorskip("transformers", reason="needs transformers (extra: hf)")

from spotguard.integrations.huggingface import (  # noqa: E402
    SpotguardTrainerCallback,
    latest_checkpoint,
)
from spotguard.integrations.lightning import SpotguardCallback  # noqa: E402

MAX_STEPS = 20


@pytest.fixture(autouse=True)
def restore_signals():
    """A clean stop leaves SIGTERM/SIGUSR1 ignored (the process is meant to exit): undo that."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def quiet_guard(**kwargs) -> Guard:
    return Guard(daemon=kwargs.pop("daemon", False), force_exit=False, **kwargs)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


# ---------------------------------------------------------------------- Lightning


class TinyModule(pl.LightningModule):
    """Records the steps it ran and its state at fit start; signals itself at ``signal_at``."""

    def __init__(self, signal_at: int | None = None, signum: int = signal.SIGUSR1) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.signal_at, self.signum = signal_at, signum
        self.ran: list[int] = []

    def on_train_start(self) -> None:
        opt = self.trainer.optimizers[0]
        self.start_weight = self.net.weight.detach().clone()
        self.start_adam_step = int(opt.state[self.net.weight]["step"]) if opt.state else 0
        self.start_lr = opt.param_groups[0]["lr"]

    def training_step(self, batch, batch_idx):
        self.ran.append(self.global_step)
        if self.global_step == self.signal_at:
            os.kill(os.getpid(), self.signum)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(module: TinyModule, callback: SpotguardCallback) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=MAX_STEPS, accelerator="cpu", logger=False, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
    trainer.fit(module, loader)
    return trainer


def step_dirs(root) -> list[str]:
    return sorted(p.name for p in root.glob("step-*"))


def test_lightning_signal_saves_stops_and_a_new_fit_resumes(tmp_path):
    root = tmp_path / "ckpt"
    first = TinyModule(signal_at=5)
    callback = SpotguardCallback(root, guard=quiet_guard())
    trainer = fit(first, callback)
    assert callback.stopped and trainer.should_stop
    assert trainer.global_step == 6 and first.ran == [0, 1, 2, 3, 4, 5]
    assert step_dirs(root) == ["step-0000000006"]  # the emergency save, nothing else
    with pytest.raises(SystemExit) as exc:
        callback.exit_if_stopped()
    assert exc.value.code == EXIT_PREEMPTED

    second = TinyModule()
    resumed = SpotguardCallback(root, guard=quiet_guard())
    trainer = fit(second, resumed)
    assert resumed.resumed_from.step == 6 and not resumed.stopped
    assert second.ran == list(range(6, MAX_STEPS))  # the step count continues
    assert torch.equal(second.start_weight, first.net.weight.detach())
    assert second.start_adam_step == 6  # optimizer state restored
    assert second.start_lr == pytest.approx(0.01 * 0.5**6)  # scheduler state restored
    assert trainer.global_step == MAX_STEPS
    assert step_dirs(root) == ["step-0000000006", "step-0000000020"]  # the final save
    resumed.exit_if_stopped()  # no notice: returns


def test_lightning_sigterm_stops_cleanly_instead_of_lightnings_sigterm_exception(tmp_path):
    root = tmp_path / "ckpt"
    module = TinyModule(signal_at=3, signum=signal.SIGTERM)
    callback = SpotguardCallback(root, guard=quiet_guard(signal_deadlines={signal.SIGTERM: 30.0}))
    trainer = fit(module, callback)  # would raise SIGTERMException without the callback's stop
    assert callback.stopped and trainer.global_step == 4
    assert step_dirs(root) == ["step-0000000004"]  # a 30 s deadline leaves room for the save


def test_lightning_ctrl_c_stops_fit_with_a_save_and_exits_130(tmp_path):
    """Lightning's own answer to Ctrl-C is a KeyboardInterrupt it shuts down on; the callback's
    guard takes the first SIGINT instead: fit ends at the next step with that step saved, 130."""
    from spotguard import _exit

    root = tmp_path / "ckpt"
    module = TinyModule(signal_at=3, signum=signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not a guard an earlier test left open
    callback = SpotguardCallback(root, guard=quiet_guard())
    try:
        trainer = fit(module, callback)
        assert callback.stopped and trainer.global_step == 4 and module.ran == [0, 1, 2, 3]
        assert step_dirs(root) == ["step-0000000004"]
        with pytest.raises(SystemExit) as exc:
            callback.exit_if_stopped()
        assert exc.value.code == 130
    finally:
        _exit._state.pop("interrupted", None)  # this test process was never interrupted for the others
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_resume_after_an_epochs_last_batch_starts_the_next_epoch_as_a_run_never_stopped(tmp_path):
    """A state saved right after an epoch's last batch (a stop there, with no room to wait for the
    epoch's end): Lightning's own restart counts that epoch done, then skips the next epoch's
    start, its counters and its ``on_train_epoch_start`` hooks. With the callback it starts."""
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)  # 8 batches an epoch

    class Saver(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 8:
                trainer.save_checkpoint(tmp_path / "last-batch.ckpt")

    class Starts(pl.Callback):
        def __init__(self):
            self.epochs = []

        def on_train_epoch_start(self, trainer, module):
            self.epochs.append(trainer.current_epoch)

    def trainer(steps, *callbacks):
        return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=list(callbacks),
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    trainer(8, Saver()).fit(TinyModule(), loader)

    def resumed(*callbacks):
        starts = Starts()
        run = trainer(20, *callbacks, starts)
        run.fit(TinyModule(), loader, ckpt_path=tmp_path / "last-batch.ckpt")
        return starts.epochs, run.fit_loop.epoch_progress.current.started

    assert resumed() == ([2], 2)  # Lightning alone: epoch 1 never started
    assert resumed(SpotguardCallback(tmp_path / "sg", guard=quiet_guard())) == ([1, 2], 3)


def test_lightning_saves_on_cadence_and_keeps_the_newest(tmp_path):
    root = tmp_path / "ckpt"
    callback = SpotguardCallback(root, save_every=6, keep=2, guard=quiet_guard())
    fit(TinyModule(), callback)
    callback.run.checkpointer.wait()
    assert not callback.stopped
    assert step_dirs(root) == ["step-0000000018", "step-0000000020"]  # 6, 12, 18, final 20; keep 2


# ---------------------------------------------------------------------- Hugging Face


class TinyModel(torch.nn.Module):
    """A model the Trainer accepts (it returns ``{"loss": ...}``); signals at call ``signal_at``."""

    def __init__(self, signal_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.signal_at, self.calls = signal_at, 0

    def forward(self, x, y):
        self.calls += 1
        if self.calls == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def collate(rows):
    return {"x": torch.stack([r[0] for r in rows]), "y": torch.stack([r[1] for r in rows])}


def train_hf(out, model: TinyModel, callback: SpotguardTrainerCallback):
    args = transformers.TrainingArguments(
        str(out), max_steps=MAX_STEPS, per_device_train_batch_size=8, save_steps=1000, use_cpu=True,
        report_to=[], logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model, args, train_dataset=dataset(), data_collator=collate,
                                   callbacks=[callback])
    trainer.train(resume_from_checkpoint=latest_checkpoint(out))
    return trainer


def test_hf_signal_saves_stops_and_a_new_train_resumes(tmp_path):
    out = tmp_path / "out"
    guard = quiet_guard()
    callback = SpotguardTrainerCallback(guard=guard)
    first = TinyModel(signal_at=5)
    trainer = train_hf(out, first, callback)
    guard.close()
    assert callback.stopped and trainer.state.global_step == 5 and first.calls == 5
    assert latest_checkpoint(out) == str(out / "checkpoint-5")  # the emergency save
    assert json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["global_step"] == 5
    assert callback.save_seconds is not None and callback.save_seconds > 0
    with pytest.raises(SystemExit) as exc:
        callback.exit_if_stopped()
    assert exc.value.code == EXIT_PREEMPTED

    second, again = TinyModel(), SpotguardTrainerCallback(guard=quiet_guard())
    trainer = train_hf(out, second, again)
    again.guard.close()
    assert not again.stopped
    assert trainer.state.global_step == MAX_STEPS and second.calls == MAX_STEPS - 5  # resumed at 5


@pytest.fixture
def linked(sock_dir):
    """A fake daemon and a guard connected to it."""
    daemon = FakeDaemon(sock_dir / "rt").start()
    guard = quiet_guard(daemon=True, pub_endpoint=daemon.pub_endpoint,
                        request_endpoint=daemon.request_endpoint)
    assert wait_for(lambda: guard.daemon_alive)
    yield daemon, guard
    guard.close()
    daemon.stop()


@pytest.mark.parametrize("deadline, save", [(30.0, "committed"), (1.0, "no_room")])
def test_hf_daemon_notice_saves_reports_the_commit_and_safe(tmp_path, linked, deadline, save, caplog):
    daemon, guard = linked
    notice = make_notice(deadline)

    class Notified(TinyModel):
        def forward(self, x, y):
            if self.calls == 2:
                daemon.publish_notice(notice)
                assert wait_for(lambda: guard.stop_requested)
            return super().forward(x, y)

    callback = SpotguardTrainerCallback(guard=guard, durable=True)
    trainer = train_hf(tmp_path / "out", Notified(), callback)
    assert callback.stopped and trainer.state.global_step == 3
    assert wait_for(lambda: daemon.requests_of("safe"))
    safe = daemon.requests_of("safe")[0]  # the stop's side of the notice timeline
    assert safe.notice_ids == [notice.id] and safe.step == 3 and safe.save == save
    assert safe.stopped_at is not None and (safe.committed_at is not None) == (save == "committed")
    if save == "no_room":  # 2 s of margin do not fit in 1 s: the last checkpoint stands
        assert daemon.requests_of("commit") == [] and not (tmp_path / "out" / "checkpoint-3").exists()
        assert "needed with save_margin=2.0 s" in caplog.text  # the margin that refused it is named
        return
    commits = daemon.requests_of("commit")  # the committed copy, in the layout the daemon uploads
    assert [c.step for c in commits] == [3] and commits[0].path.endswith("spotguard/step-0000000003")
    assert commits[0].size_bytes > 0 and commits[0].files >= 3


def test_hf_advisory_notice_asks_for_one_early_save(tmp_path, linked):
    daemon, guard = linked

    class Advised(TinyModel):
        def forward(self, x, y):
            if self.calls == 3:
                daemon.publish_notice(make_notice(900, terminating=False, kind="rebalance"))
                assert wait_for(lambda: guard.checkpoint_requested)
            return super().forward(x, y)

    callback = SpotguardTrainerCallback(guard=guard)
    trainer = train_hf(tmp_path / "out", Advised(), callback)
    assert not callback.stopped and trainer.state.global_step == MAX_STEPS
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == [
        "checkpoint-20", "checkpoint-4"]  # the early save, then the Trainer's final one
    assert daemon.requests_of("commit") == []  # no durable store known: no copies, no reports
    assert not (tmp_path / "out" / "spotguard").exists()


def test_latest_checkpoint_skips_partial_directories(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (5, 12):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-30").mkdir()  # cut off by the kill before trainer_state.json
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-12")
