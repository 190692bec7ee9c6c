"""Exact resume through the framework callbacks, and Lightning's Slurm requeue beside the guard.

The resume tests run ``_integration_jobs.py`` (a user-style job: shuffled loader, dropout, AdamW)
as real subprocesses: once uninterrupted, then with ``$JOB_STOPS`` making it SIGTERM itself at
three points (the SIGTERM lands inside step N, the stop comes after it), relaunching the
identical command after each exit 75 until it exits 0. The final weights and optimizer state must
be bit-identical to the uninterrupted run's. Each launch is a fresh process forked by a JobServer
(tests/client/_jobserver.py) that imported torch, Lightning and transformers once: a fresh
interpreter spent 7-9 s of a 14 s launch importing them.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (extra: lightning)")
transformers = pytest.importorskip("transformers", reason="needs transformers (extra: hf)")

from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: E402
from _jobserver import JobServer  # noqa: E402
from test_integrations import (  # noqa: E402, F401
    TinyModel,
    TinyModule,
    collate,
    dataset,
    quiet_guard,
    restore_signals,
)

from spotguard import EXIT_PREEMPTED  # noqa: E402
from spotguard.integrations.huggingface import SpotguardTrainerCallback  # noqa: E402
from spotguard.integrations.lightning import SpotguardCallback  # noqa: E402

JOB = Path(__file__).with_name("_integration_jobs.py")


@pytest.fixture(scope="module")
def server():
    srv = JobServer(("lightning.pytorch", "transformers.trainer"))
    yield srv
    srv.close()


def launch(server: JobServer, kind: str, out: Path, stops: str, knobs: dict[str, str],
           number: int) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    env.update(knobs, JOB_STOPS=stops, OMP_NUM_THREADS="1", SPOTGUARD_RUNTIME_DIR=str(out) + ".rt")
    log = out.with_name(f"{out.name}-{number}.log")
    return server.run([str(JOB), kind, str(out)], env, log), log.read_text()


def run_to_the_end(server: JobServer, kind: str, out: Path, stops: str,
                   knobs: dict[str, str]) -> tuple[str, list[int], str]:
    """Relaunch the identical command until it exits 0, also after a SIGKILL of ``$JOB_CRASH``:
    (digest, steps it stopped at, output)."""
    stopped, output = [], ""
    for number in range(6):
        code, text = launch(server, kind, out, stops, knobs, number)
        output += text
        if code == -signal.SIGKILL and "JOB_CRASH" in knobs:
            continue
        if code != EXIT_PREEMPTED:
            break
        stopped.append(int(re.findall(r"stopping at step (\d+)", text)[-1]))
    assert code == 0, output
    return re.findall(r"^DIGEST (\w+)$", output, re.M)[-1], stopped, output


def epoch_ends(output: str) -> int:
    """How many epoch ends the last launch's hooks counted (its state includes the earlier ones')."""
    return int(re.findall(r"^EPOCH_ENDS (\d+)$", output, re.M)[-1])


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind, knobs, stops, expected", [
    # mid-epoch twice, then inside an epoch's last batch (12 batches an epoch): that stop waits
    # for the epoch's end and comes after the next epoch's first step
    ("lightning", {}, "5,17,23", [6, 18, 25]),
    # 2 persistent loader workers, 2 batches a step: every stop is mid-epoch (6 steps an epoch)
    ("lightning", {"JOB_WORKERS": "2", "JOB_ACCUMULATE": "2"}, "4,8,13", [5, 9, 14]),
    ("hf", {}, "5,11,19", [6, 12, 20]),
], ids=["lightning", "lightning-workers-accumulate", "hf"])
def test_shuffled_dropout_job_stopped_three_times_ends_bit_identical(server, tmp_path, kind, knobs,
                                                                      stops, expected):
    reference, none, reference_output = run_to_the_end(server, kind, tmp_path / "reference", "", knobs)
    assert none == []
    final, stopped, output = run_to_the_end(server, kind, tmp_path / "stopped", stops, knobs)
    assert stopped == expected
    assert final == reference  # Lightning: also its epoch counters and the epoch starts' hooks
    assert "not resumable" not in output  # Lightning's own warning about plain loaders
    if kind == "lightning":
        assert epoch_ends(output) == epoch_ends(reference_output)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_lightning_killed_around_validations_and_epoch_ends_resumes_them_exactly(server, tmp_path):
    """A validation every 8 batches, 12 batches an epoch, ``ReduceLROnPlateau`` on the validation's
    metric each epoch, ``EarlyStopping`` on it. Lightning resumes after the validation or epoch end
    that follows a saved batch, so the periodic saves due at steps 8 and 12 are taken at 9 and 13.
    Killed at 10 (resumed from 9: the epoch's end at 12 steps the scheduler on the metric of step
    8's validation, which the checkpoint carries) and at 15 (resumed from 13), then stopped inside
    step 21 (resumed mid-epoch: the scheduler steps at that epoch's end too). The weights,
    optimizer, scheduler, EarlyStopping state, epoch counters and the hooks' counts of epoch
    starts, ends and validations are the uninterrupted run's."""
    knobs = {"JOB_VALIDATE": "1", "JOB_CRASH": "10,15"}
    reference, _, reference_output = run_to_the_end(server, "lightning", tmp_path / "reference", "",
                                                    {"JOB_VALIDATE": "1"})
    final, stopped, output = run_to_the_end(server, "lightning", tmp_path / "stopped", "20", knobs)
    assert [int(s) for s in re.findall(r"resumed from step (\d+)", output)] == [9, 13, 21]
    assert stopped == [21]
    assert final == reference, output
    assert epoch_ends(output) == epoch_ends(reference_output)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_lightning_stopped_before_a_validation_or_an_epoch_end_waits_for_them(server, tmp_path):
    """SIGTERM (30 s to the kill) inside step 16, after which Lightning validates, and inside step
    24, after which it validates and ends the epoch: the stop waits for that work and comes at the
    next step's end (17, 25), so the resumed run skips nothing: weights, optimizer, scheduler,
    EarlyStopping, epoch counters and the hooks' counts of epoch starts, ends and validations are
    the uninterrupted run's. A stop at step 16 or 24 saved the state before them, and the resumed
    run never validated there."""
    knobs = {"JOB_VALIDATE": "1"}
    reference, _, reference_output = run_to_the_end(server, "lightning", tmp_path / "reference", "", knobs)
    final, stopped, output = run_to_the_end(server, "lightning", tmp_path / "stopped", "15,23", knobs)
    assert stopped == [17, 25]
    assert output.count("so that the resumed run does not skip it") == 2
    assert final == reference, output
    assert epoch_ends(output) == epoch_ends(reference_output)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_lightning_stopped_with_no_room_before_an_epochs_last_validation_resumes_into_it(server, tmp_path):
    """SIGTERM 3 s from the kill inside step 24, the epoch's last, after which a 1.2 s validation
    and the epoch's end come: no room to wait (the validation after step 8 took as long), so the
    stop saves step 24 before them. The relaunch validates at 24 and ends the epoch (hooks, the
    plateau step on the metric), and ends as the uninterrupted run."""
    knobs = {"JOB_VALIDATE": "1", "JOB_VALIDATION_SLEEP": "0.1"}
    reference, _, reference_output = run_to_the_end(server, "lightning", tmp_path / "reference", "", knobs)
    final, stopped, output = run_to_the_end(server, "lightning", tmp_path / "stopped", "23",
                                            {**knobs, "SPOTGUARD_SIGNAL__GRACE": "3"})
    assert stopped == [24] and "does not skip it" not in output
    assert final == reference, output
    assert epoch_ends(output) == epoch_ends(reference_output)


def test_sigterm_between_accumulating_batches_still_stops_with_a_save(tmp_path):
    """Lightning raises its SIGTERMException after a non-stepping batch unless the callback,
    which stops at the next step boundary, keeps it from doing so (it used to end fit with 0)."""
    callback = SpotguardCallback(tmp_path, guard=quiet_guard(signal_deadlines={signal.SIGTERM: 30}))
    module = TinyModule(signal_at=2, signum=signal.SIGTERM)
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", logger=False, callbacks=[callback],
                         accumulate_grad_batches=2, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(dataset(), batch_size=8))
    assert callback.stopped and trainer.global_step == 3
    assert (tmp_path / "step-0000000003").is_dir()


# ---------------------------------------------------------------------- what cannot be exact


class Augmented(torch.utils.data.Dataset):
    """Random per-sample noise from the global torch RNG: not replayed on resume."""

    def __init__(self) -> None:
        self.rows = dataset()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        x, y = self.rows[index]
        return x + 0.01 * torch.randn_like(x), y


def fit_on(data, callback: SpotguardCallback, steps: int = 6, **trainer_kwargs) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **trainer_kwargs)
    trainer.fit(TinyModule(), torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
    return trainer


def inexact_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not be bit-identical" in r.getMessage()]


def test_augmenting_dataset_is_warned_once_at_the_first_save(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="spotguard")
    fit_on(Augmented(), SpotguardCallback(tmp_path, save_every=2, guard=quiet_guard()))
    found = inexact_warnings(caplog)
    assert len(found) == 1 and "__getitem__" in found[0] and "generator seeded" in found[0]


def test_plain_shuffled_loader_saves_without_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="spotguard")
    fit_on(dataset(), SpotguardCallback(tmp_path, save_every=2, guard=quiet_guard()))
    assert inexact_warnings(caplog) == []


def test_the_loader_draws_nothing_from_the_global_rng(tmp_path):
    """The cause of the divergence: the loader's seeds now come from its own generator."""
    callback = SpotguardCallback(tmp_path, guard=quiet_guard())
    trainer = fit_on(dataset(), callback, steps=1)
    loader, data = trainer.fit_loop._combined_loader.flattened[0], callback.data
    assert (loader.sampler.generator, loader.generator) == data._loaders[0][1:]

    def epoch(number: int) -> list:
        data.epoch = number
        data._reseed()
        return [b[1].tolist() for b in loader]

    state = torch.get_rng_state()
    first = epoch(0)
    assert torch.equal(torch.get_rng_state(), state)
    assert epoch(1) != first and epoch(0) == first  # a pure function of (seed, epoch)


@pytest.mark.parametrize("skip", [True, False])
def test_hf_ignore_data_skip_is_warned_once_at_the_first_save(tmp_path, caplog, skip):
    caplog.set_level(logging.WARNING, logger="spotguard")
    args = transformers.TrainingArguments(
        str(tmp_path), max_steps=6, per_device_train_batch_size=8, save_steps=2, use_cpu=True,
        report_to=[], logging_strategy="no", disable_tqdm=True, ignore_data_skip=skip)
    callback = SpotguardTrainerCallback(guard=quiet_guard())
    transformers.Trainer(TinyModel(), args, train_dataset=dataset(), data_collator=collate,
                         callbacks=[callback]).train()
    callback.guard.close()
    found = inexact_warnings(caplog)
    assert found == (["resume will not be bit-identical: ignore_data_skip=True restarts the epoch "
                      "from its first batch; leave it False"] if skip else [])


# ---------------------------------------------------------------------- Slurm auto-requeue


def test_lightning_slurm_requeue_still_runs_beside_the_guard(tmp_path, monkeypatch):
    """SIGUSR1 under Slurm: the guard stops with a save, and Lightning's requeue runs too."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o700)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name, value in dict(SLURM_JOB_ID="4242", SLURM_NTASKS="1", SLURM_PROCID="0",
                            SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_NAME="train").items():
        monkeypatch.setenv(name, value)
    callback = SpotguardCallback(tmp_path / "ckpt", guard=quiet_guard())
    module = TinyModule(signal_at=3, signum=signal.SIGUSR1)
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", logger=False, callbacks=[callback],
                         plugins=[SLURMEnvironment()], default_root_dir=tmp_path,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(dataset(), batch_size=8))
    assert callback.stopped and trainer.global_step == 4  # spotguard's stop and emergency save
    assert (tmp_path / "ckpt" / "step-0000000004").is_dir()
    assert calls.read_text().split() == ["requeue", "4242"]  # Lightning's auto-requeue ran
    assert list(tmp_path.glob("hpc_ckpt_*.ckpt"))  # and its own hpc checkpoint
