"""A PyTorch Lightning callback with the contract of :class:`spotguard.Run`.

::

    from spotguard.integrations.lightning import SpotguardCallback

    guard = SpotguardCallback("checkpoints", save_every=500)   # or a Cadence: Young/Daly
    trainer = L.Trainer(max_steps=10_000, callbacks=[guard])
    trainer.fit(model, datamodule)        # resumes from the latest spotguard checkpoint, if any
    guard.exit_if_stopped()               # SystemExit(75) after a notice: requeue the job

What is saved (one spotguard checkpoint per save, atomic, pickle-free): Lightning's own checkpoint
dict, ``trainer._checkpoint_connector.dump_checkpoint()``: model weights, optimizer and LR-scheduler
states, precision-plugin state (the AMP grad scaler), the loops' progress (global step, epoch,
batch position), callback states (``ModelCheckpoint``, ``EarlyStopping``), a stateful datamodule
and whatever ``on_save_checkpoint`` adds; plus the Python/NumPy/torch RNG states of every rank.
Entries the pickle-free format cannot store (hyper-parameters holding arbitrary objects, typically)
are left out with a warning: the script builds the module with its hyper-parameters anyway.

Why Lightning's dict and not the optimizer and module objects directly: Lightning owns the loop
state (progress counters, ``restarting`` flags, per-epoch scheduler steps), and only its own restore
code puts it back consistently. Restoring goes through the same connector methods that
``trainer.fit(ckpt_path=...)`` uses (``restore_model``, ``restore_datamodule``,
``restore_callbacks``, ``restore_training_state``), called from ``on_fit_start`` (after the strategy
set up the optimizers, before the fit loop starts). A spotguard checkpoint, when one exists, wins
over a ``ckpt_path`` given to ``fit``. Private names touched: ``_checkpoint_connector``,
``_signal_connector``'s ``_sigterm_notifier_fn`` and ``received_sigterm`` (see SIGTERM below), and
for validations and epoch ends (below) ``fit_loop._restarting``, ``fit_loop._data_fetcher``,
``epoch_loop._should_check_val_fx`` and ``_logger_connector._callback_metrics``. Tested with
Lightning 2.6.

Validations and epoch ends: Lightning resumes *after* the validation and the epoch end that follow
a saved batch. A periodic save due at such a batch is therefore taken at the next step
(:attr:`Run.hold_saves`), when the validation's effects (callback states, a ``ReduceLROnPlateau``
step) and the epoch-end hooks are in the state. ``trainer.callback_metrics`` are saved and put
back, and the first epoch end after a resume steps ``ReduceLROnPlateau`` schedulers, which
Lightning's own restart skips. A stop at such a batch, or a notice during a validation, waits for
that work when the deadline leaves room (one process, :meth:`SpotguardCallback._stop_waits`). A
state saved before a validation (a stop with no room, or on several ranks) is saved as a validation
just begun (:func:`_resume_into_validation`): the resumed run runs it again. A resume right after an
epoch's last batch counts the next epoch started and calls its ``on_train_epoch_start`` hooks
(Lightning's restart skips both). Still inexact: such a stop right before an epoch end that no
validation precedes (the resumed job skips that epoch's end hooks), and epoch-level aggregates of
training metrics after a mid-epoch resume.

SIGTERM: Lightning 2.6 registers a SIGTERM handler of its own after ``on_fit_start``, which
broadcasts a tensor from inside the handler on whichever rank got the signal (a collective the
other ranks never match: gloo errors or a hang under DDP) and makes its loops raise
``SIGTERMException`` (status 0, no save). The callback replaces that notifier in ``on_fit_start``
by one that only forwards the signal to processes Lightning launched itself; the guard holds the
signal and the ranks agree on one step at which every rank saves once and stops (75). Tested under
``torchrun`` at 1-3 ranks with SIGTERM to the launcher, to the workers and a daemon notice.

Data position and RNG streams (:mod:`spotguard.integrations._lightning_data`): the callback gives
each plain train ``DataLoader`` its own generator, reseeded per epoch from ``(seed, epoch)``, so the
shuffle and the worker seeds no longer draw from the global torch RNG, and it saves the position
inside the epoch, skipping the consumed batches at resume. With the global RNG states saved too,
``DataLoader(shuffle=True)`` plus dropout resumes bit-identically on CPU. What cannot be made exact
(random augmentation drawing from a global RNG in the dataset, a loader without a
``BatchSampler``) is warned about once, at the first save. Stateful loaders (torchdata's
``StatefulDataLoader``) are left to Lightning's own loader state.

Slurm: the guard installs its SIGUSR1 handler before Lightning registers its own, and Lightning
registers its auto-requeue handler only on a free signal; so under a ``SLURMEnvironment`` with
``auto_requeue`` the callback chains Lightning's requeue handler after the guard's (the guard stops
with a save, Lightning saves its ``hpc_ckpt`` and runs ``scontrol requeue``).

Step numbers are ``trainer.global_step``. Boundaries come at ``on_train_batch_end`` of a batch that
stepped the optimizer (never in the middle of gradient accumulation, whose partial gradients are not
saved). At each boundary :class:`~spotguard.Run` decides (cadence, notice, ranks' agreement): a due
save runs asynchronously; on a notice an emergency save is taken when it fits before the deadline,
the pending save is awaited, the daemon is told the process is safe, ``trainer.should_stop`` is set
(without the validation Lightning runs when asked to stop) and :attr:`SpotguardCallback.stopped` becomes True. A normal end of training saves the final state.
After a stop the process is expected to exit (as with ``Run``): the forced-exit watchdog stays
armed and SIGTERM/SIGUSR1 stay ignored, so call :meth:`~SpotguardCallback.exit_if_stopped` (75)
right after ``fit``.

Distributed: DDP works as with ``Run`` (flags agreed across ranks, rank 0 writes the model, every
rank its RNG, and the gradient bucket layout of ``trainer.strategy.model`` is checkpointed and
restored, :mod:`spotguard._ddp`, so 3+ ranks resume bit-identically). A collective that fails
because a peer rank is gone (``on_exception``), the ranks' exchange failing, or no step boundary
for ``peer_timeout`` end the process with 77 as in ``Run``; ``stop_lead`` is ``Run``'s far-deadline
rule. A notice during a validation inside ``fit`` with one process waits for the validation's end
when the deadline leaves room (above); else it is acted on at the next validation batch
end: the state kept when the validation began (Lightning's dict, data position, RNG) is saved and ``fit``
ends with ``SystemExit(75)``; the relaunch runs that validation again. The RNG states of the batch
the validation follows are put back at its end, so it never changes training (also when run again)
and such a stop resumes bit-identically. With several ranks the batch ends are agreement
points (``Run(agree_at_heartbeat=True)``, :mod:`spotguard._heartbeat`): every rank saves that step and
exits 75 together. This needs every rank to run the same number of validation batches inside ``fit``
(Lightning's ``DistributedSampler`` pads to that; the sanity check runs on every rank too, before any
step, so a notice then waits for the first boundary); a validation whose batches differ between ranks
(one on rank 0 alone) would leave ranks waiting for each other's exchange (``HeartbeatMismatch``, or 77
at ``peer_timeout``): pass ``agree_in_validation=False`` there, and a notice waits for the next step. Tested
under ``torchrun`` with ``strategy="ddp"``, SIGTERM to one rank mid-validation. Sharded strategies
(FSDP, DeepSpeed) are not supported: their optimizer state is gathered with collectives that only
rank 0 would call here.

Exceptions: those of :class:`spotguard.Run` (``CheckpointError`` from a failed save or load).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from spotguard import _ddp, _exit, rng
from spotguard._between import Frozen as _Frozen
from spotguard._peer import exit_peer_lost, is_peer_failure
from spotguard.checkpoint.errors import UnsupportedStateError
from spotguard.checkpoint.format import encode
from spotguard.exit_codes import EXIT_PREEMPTED
from spotguard.guard import DEFAULT_SIGNAL_DEADLINES, Guard
from spotguard.integrations._lightning_data import DataPosition
from spotguard.run import Run

__all__ = ["SpotguardCallback"]

log = logging.getLogger(__name__)

_METRICS = "spotguard_callback_metrics"
"""The key of ``trainer.callback_metrics`` in the Lightning dict spotguard saves."""

_ENDLESS = 2**62
"""The step budget handed to :meth:`Run.steps`: the trainer, not spotguard, decides when to end."""


class SpotguardCallback(pl.Callback):
    """Checkpoint, resume and stop cleanly inside ``trainer.fit``; see the module docstring.

    The arguments are :class:`spotguard.Run`'s (``durable``: the store a fresh node restores
    from). The :class:`Run` is built in ``on_fit_start``
    (after Lightning started ``torch.distributed``, so every rank agrees on stops and saves) and
    is available as :attr:`run` from then on.

    :param root: The checkpoint directory (``Run``'s).
    :param keep: Committed checkpoints kept.
    :param save_every: Save every this many steps (else ``cadence``, else ``$SPOTGUARD_SAVE_EVERY``,
        else Young/Daly).
    :param cadence: A :class:`~spotguard.cadence.Cadence` that decides when to save.
    :param job_id: The job's id in the daemon and the durable store (default: derived).
    :param save_margin: Seconds kept free between an emergency save's end and the deadline.
    :param stop_lead: Seconds before the latest safe stop at which a far-off notice stops.
    :param peer_timeout: Seconds after which a lost peer rank ends the process with 77 (None: off).
    :param daemon: Listen to the node's daemon; False: signals only.
    :param signal_deadlines: Seconds from each stop signal to the kill (None: no deadline).
    :param on_commit: Called with each commit's :class:`~spotguard.checkpoint.CommitInfo`.
    :param guard: A :class:`~spotguard.guard.Guard` to use instead of building one.
    :param durable: URL of the durable store a fresh node restores from.
    :param agree_in_validation: With several ranks, agree on a notice at each validation batch's
        end, as ``Run(agree_at_heartbeat=True)``; every rank must then run the same number of
        validation batches inside ``fit`` (Lightning's ``DistributedSampler`` does). Turn it off
        for a validation whose batches differ between ranks: a notice then waits for the next step.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep: int = 3,
        save_every: int | None = None,
        cadence: Any = None,
        job_id: str = "",
        save_margin: float = 2.0,
        stop_lead: float = 60.0,
        peer_timeout: float | None = 600.0,
        daemon: bool = True,
        signal_deadlines: Mapping[int, float | None] = DEFAULT_SIGNAL_DEADLINES,
        on_commit: Callable[[Any], None] | None = None,
        guard: Guard | None = None,
        durable: str | None = None,
        agree_in_validation: bool = True,
    ) -> None:
        self.root = root
        self._run_kwargs = dict(keep=keep, save_every=save_every, cadence=cadence, job_id=job_id,
                                save_margin=save_margin, stop_lead=stop_lead, peer_timeout=peer_timeout,
                                daemon=daemon, on_commit=on_commit,
                                signal_deadlines=signal_deadlines, guard=guard, durable=durable,
                                exit_on_stop=False, agree_at_heartbeat=agree_in_validation)
        self.run: Run | None = None
        self.data: DataPosition | None = None
        self.resumed_from: Any = None
        self.stopped = False
        self._steps: Any = None
        self._last_step: int | None = None
        self._paused: tuple[int, Any, Any, Any] | None = None
        """At a validation inside fit: (step, Lightning's checkpoint dict, data position, RNG states)."""
        self._held_at: float | None = None  # when the last batch followed by a validation or epoch end ended
        self._tail_s: float | None = None
        """The longest time from such a batch's end to the next step's end: the validation, the
        epoch's end, the next epoch's start and a step."""
        self._waited = False  # a stop is waiting for that work (one process)
        self._before_validation: Any = None  # RNG states at the end of a batch a validation follows
        self._val_tick: float | None = None  # the last validation batch's end
        self._val_batch_s = 0.0  # the longest validation batch

    def exit_if_stopped(self) -> None:
        """Raise ``SystemExit(EXIT_PREEMPTED)`` (75) when training stopped because of a notice."""
        if self.stopped:
            raise _exit.stop_exit(EXIT_PREEMPTED)  # a SystemExit that also exits promptly

    # ------------------------------------------------------------------ Lightning hooks

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the Run and restore the latest spotguard checkpoint, if there is one."""
        self.stopped = False
        self.data = DataPosition(trainer)
        state = {"lightning": _TrainerState(trainer), "data": self.data,
                 **_ddp.entries({"model": trainer.strategy.model})}  # DDP's bucket layout
        self.run = Run(self.root, state=state, **self._run_kwargs)
        self.run._heartbeats.capture = self._kept_at_validation  # several ranks: the state to save
        _keep_slurm_requeue(trainer)
        _quiet_lightning_sigterm(trainer)
        self.run.record.total = trainer.max_steps if trainer.max_steps > 0 else None  # the record's budget
        self._steps = self.run.steps(_ENDLESS)  # loads the latest checkpoint on the first next()
        self._advance(trainer, trainer.global_step)
        self.resumed_from = self.run.resumed_from
        self._last_step = trainer.global_step
        self.data.install()  # after the restore: the loaders are built next, in the fit loop

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning reset its loops and metrics: put back what a run never stopped has here."""
        _start_the_next_epoch(trainer.fit_loop)
        if self.run is not None:
            self.run.state["lightning"].restore_metrics()
        if self.resumed_from is not None:  # a state saved before a validation resumes into it
            self._before_validation = rng.capture()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The first epoch's end after a resume: Lightning 2.6 skips its ``ReduceLROnPlateau``
        step there (its checkpoints hold no metrics); spotguard's put the metrics back, so step it
        as a run never stopped does."""
        loop = trainer.fit_loop
        if loop.restarting and self.resumed_from is not None:
            loop._restarting = False  # this loop's flag only; Lightning clears it after this epoch anyway

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.data is not None:
            self.data.epoch_started()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """A step boundary when the optimizer stepped: save if due, stop on a notice."""
        if self.data is not None:
            self.data.batch_done()  # every batch, also the accumulating ones
        self._defer_sigterm(trainer)
        # the RNG states a validation after this batch gives back at its end: taken before it makes
        # its loader's iterator (a shuffled one draws), so that one run again from its start draws alike
        validates = self.run is not None and _validates_after(trainer)
        self._before_validation = rng.capture() if validates else None
        if self._steps is None or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        assert self.run is not None
        self.run.step = trainer.global_step - 1  # keep Run's count on Lightning's (multi-optimizer)
        # a validation or the epoch's end follows: Lightning would resume after it, so a due save
        # waits for the next boundary (Run.hold_saves; both are alike on every rank)
        held = self.run.hold_saves = validates or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        self._measure_tail(held)
        if held and self._stop_waits(trainer.global_step):
            return  # the next step's end acts on it, after Lightning's validation and epoch end
        self._advance(trainer, trainer.global_step)
        self._waited = False
        if 0 < trainer.max_steps <= trainer.global_step and not self.stopped:
            self.run.finish(at_boundary=True)  # the last step's state, where any run saves it

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A validation inside ``fit``: keep what a stop during it saves, the last step's state
        (Lightning's checkpoint dict, the data position and the RNG states, taken now)."""
        run = self.run
        if run is None or self.stopped or trainer.sanity_checking or trainer.state.fn != "fit" or \
                (run.agreement.enabled and not run._heartbeats.enabled):
            return  # (Lightning validates once more after a stop, before fit returns)
        self._paused = (trainer.global_step, run.state["lightning"].state_dict(), self.data.state_dict(),
                        self._before_validation or rng.capture())

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._defer_sigterm(trainer)
        now = time.monotonic()
        if self._val_tick is not None:
            self._val_batch_s = max(self._val_batch_s, now - self._val_tick)
        self._val_tick = now
        if self.run is not None:
            # a long validation between two steps is not a lost peer; with several ranks, where they
            # agree on a notice and save the state kept at the validation's start (True: stopped)
            if self.run.heartbeat():
                self._end_fit()
            if self._paused is not None and not self.run.agreement.enabled and self.run.guard.stop_requested:
                self._stop_in_validation()

    def _kept_at_validation(self) -> tuple[int, dict[str, Any]] | None:
        """(step, the state to save) kept when the validation began, for a stop agreed at a heartbeat."""
        if self._paused is None:
            return None  # the sanity check, before any step: the next boundary acts
        assert self.run is not None
        return self._paused[0], self._frozen_state()

    def _frozen_state(self) -> dict[str, Any]:
        """The Run's state with Lightning's dict, the data position and the RNG kept at validation start."""
        assert self.run is not None and self._paused is not None
        _, lightning, data, rng_state = self._paused
        return dict(self.run.state, lightning=_Frozen(lightning), data=_Frozen(data), rng=_Frozen(rng_state))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put back the RNG states of the end of the batch it follows (before its loader's iterator
        drew its order): it draws nothing training sees, and one run again from a stop during it
        draws what it drew the first time."""
        self._val_tick = None
        if self._paused is not None:
            rng.restore(self._paused[3])
            self._paused = None

    def _stop_in_validation(self) -> None:
        """A stop decided during a validation (the far-deadline rule as at a step end): save the
        state kept at its start and end ``fit`` with ``SystemExit(75)`` now, not after it."""
        assert self.run is not None and self._paused is not None
        step = self._paused[0]
        if self._stop_waits(step) or (self._waited and not self._must_stop_now()):
            return  # the stop waits for this validation's end: the deadline still leaves room
        decision = self.run._local_decision(step)
        if not decision.stop:
            return
        log.warning("spotguard stops during the validation after step %d", step)
        self.run._stop(step, decision, state=self._frozen_state())
        self._end_fit()

    def _end_fit(self) -> None:
        """After a stop's save during a validation: end ``fit`` with ``SystemExit(75)``."""
        self.stopped, self._steps, self._paused = True, None, None
        raise _exit.stop_exit(EXIT_PREEMPTED)  # through Lightning's on_exception: fit ends here

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training ended without a notice: save the final state and close."""
        if self.run is not None and not self.stopped:
            self.run.finish(at_boundary=True)  # Lightning's loop ended between two steps
        self._steps = None
        self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Fit failed or was interrupted: close without saving (the last commit stands). A
        collective that failed because a peer rank is gone ends the process with 77, as in ``Run``."""
        if self.run is not None and is_peer_failure(exception):
            exit_peer_lost(exception, self.run.record, trainer.global_step)
        if self.run is not None:
            self.run.close(exiting=isinstance(exception, SystemExit))
        self._steps = None
        self._release()

    # ------------------------------------------------------------------ internals

    def _defer_sigterm(self, trainer: pl.Trainer) -> None:
        """The guard took the signal and stops at the next step boundary, with a save: keep
        Lightning from raising its ``SIGTERMException`` first (between accumulating batches or
        inside validation), which would end ``fit`` without a save and the process with 0."""
        if self.run is not None and self.run.guard.stop_requested:
            connector = getattr(trainer, "_signal_connector", None)
            if connector is not None:
                connector.received_sigterm = False

    def _measure_tail(self, held: bool) -> None:
        """Time Lightning's work after a batch that it follows with a validation or an epoch end:
        from that batch's end to the next step's end."""
        now = time.monotonic()
        if self._held_at is not None:
            self._tail_s = max(self._tail_s or 0.0, now - self._held_at)
        self._held_at = now if held else None

    def _stop_waits(self, step: int) -> bool:
        """One process, a stop requested, and Lightning validates or ends the epoch after this
        batch: a stop here would save the state before that work, which the resumed run then skips
        (Lightning's restart counts it done). When the deadline leaves room for that work, a step and the
        save (half again the longest such wait seen in this process, else four steps and 2 s; twice
        the save), stop at the next step's end instead. A validation is watched batch by batch
        (:meth:`_must_stop_now`). Several ranks stop here: their decision is agreed, the room would
        not be."""
        run = self.run
        assert run is not None
        if self._waited or self.stopped or run.agreement.enabled or not run.guard.stop_requested:
            return False
        left, save = run.guard.seconds_left(), run.expected_save_seconds() or 0.0
        step_s = getattr(run.cadence, "step_s", None) or 0.0
        tail = self._tail_s if self._tail_s is not None else 4 * step_s + 2.0
        if left is not None and left <= 1.5 * tail + 2 * save + run.save_margin:
            return False
        self._waited = True
        log.warning("spotguard stops after the validation or epoch end that follows step %d (%s), so "
                    "that the resumed run does not skip it", step,
                    "no deadline" if left is None else f"{left:.1f} s left")
        return True

    def _must_stop_now(self) -> bool:
        """During a validation a stop waits for: whether the deadline no longer leaves room for the
        rest of it (another batch), a step and the save; then the state before it is saved."""
        run = self.run
        assert run is not None
        left = run.guard.seconds_left()
        if left is None:
            return False
        step_s = getattr(run.cadence, "step_s", None) or 0.0
        return left <= 2 * ((run.expected_save_seconds() or 0.0) + step_s + self._val_batch_s) + run.save_margin

    def _release(self) -> None:
        if self.data is not None:
            self.data.uninstall()

    def _advance(self, trainer: pl.Trainer, step: int) -> None:
        """Let the Run act on the boundary after ``step``; it ends its iteration on a stop."""
        if next(self._steps, None) is None:
            log.warning("spotguard stopped training at step %d", step)
            self.stopped = True
            self._steps = None
            trainer.should_stop = True
            # Lightning validates once more when fit is asked to stop (for EarlyStopping): here
            # that is a whole validation between the save and the exit, under the deadline
            trainer.fit_loop.epoch_loop._skip_next_val = True
            connector = getattr(trainer, "_signal_connector", None)
            if connector is not None:  # the stop is clean: no SIGTERMException after it
                connector.received_sigterm = False


def _validates_after(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates after this batch (counted in batches: alike on every rank)."""
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return False
    try:
        return bool(trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except Exception:  # noqa: BLE001 -- another Lightning: as before
        return False


def _resume_into_validation(checkpoint: dict[str, Any]) -> None:
    """A state saved before a validation (a stop at the batch it follows, or during it, from its
    start): give the saved progress the shape of a checkpoint taken as that validation began,
    the batch's end done and the validation at its first batch. Lightning's restart then runs the
    whole validation and the rest of the batch's end (a ``ReduceLROnPlateau`` stepped on its
    metric), then the epoch's end when it was the last batch, instead of counting them done."""
    try:
        loop = checkpoint["loops"]["fit_loop"]
        batches, validation = loop["epoch_loop.batch_progress"], loop["epoch_loop.val_loop.batch_progress"]
        if batches["total"]["completed"] == batches["total"]["processed"] - 1:  # at on_train_batch_end
            batches["total"]["completed"] += 1
            batches["current"]["completed"] += 1
        validation["total"]["ready"] += 1
        validation["total"]["started"] += 1
        validation["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
        validation["is_last_batch"] = False
    except (KeyError, TypeError):  # another Lightning's layout: its own restart, as before
        return


def _callback_metrics(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """``trainer.callback_metrics`` to save: the tensors, less the epoch aggregates of what the
    training steps logged (``on_epoch=True``). After a mid-epoch resume those cover only the
    batches since the resume, so saving them would make every later checkpoint differ from a run
    never stopped's; the validation's metrics and the per-step values are exact."""
    aggregated = set()
    for metric in getattr(trainer.fit_loop.epoch_loop, "_results", {}).values():
        meta = getattr(metric, "meta", None)
        if meta is not None and meta.on_epoch:
            aggregated.add(meta.forked_name(False))
    return {key: value.detach() for key, value in trainer.callback_metrics.items()
            if isinstance(key, str) and isinstance(value, torch.Tensor) and key not in aggregated}


def _start_the_next_epoch(loop: Any) -> None:
    """Resumed from the state after an epoch's last batch (a stop there saves it): Lightning 2.6
    counted the epoch done in its ``reset``, but the stage it keeps (restarted mid-epoch) then
    skips counting the next epoch as started and its ``on_train_epoch_start`` hooks (the module's,
    every callback's). Clear that stage, so the next epoch starts as in a run never stopped."""
    epoch_loop = getattr(loop, "epoch_loop", None)
    if getattr(loop, "restarted_mid_epoch", False) and \
            getattr(epoch_loop, "restarted_on_train_batch_end", False) and \
            epoch_loop.batch_progress.is_last_batch:
        loop.reset_restart_stage()


def _quiet_lightning_sigterm(trainer: pl.Trainer) -> None:
    """Keep Lightning's SIGTERM handler (registered after ``on_fit_start``) from acting on its own.

    Lightning 2.6's handler broadcasts a tensor over the default group from inside the signal
    handler, on whichever rank got the signal, at whatever point its loop was: a collective that
    the other ranks never match (gloo errors, a hang, or DDP's all-reduce summing the wrong
    buffers); and then its loops raise ``SIGTERMException`` (status 0, no save). The guard already
    holds the signal, and the ranks agree on one step at which all stop with one save. What is kept:
    forwarding the signal to the processes Lightning itself launched (not torchrun's workers).
    """
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, "_sigterm_notifier_fn"):
        return

    forwarded: list[int] = []

    def forward_only(signum: int, frame: Any) -> None:
        launcher = trainer.strategy.launcher
        if not forwarded and launcher is not None:
            forwarded.append(signum)
            launcher.kill(signum)

    connector._sigterm_notifier_fn = forward_only


def _keep_slurm_requeue(trainer: pl.Trainer) -> None:
    """Chain Lightning's Slurm auto-requeue handler after the guard's on the requeue signal.

    Lightning installs its handler only when the signal has none yet, and the guard installed
    its own first; so, as Lightning would, requeue the job too (the requeued job resumes from
    the spotguard checkpoint, which wins over Lightning's ``hpc_ckpt``).
    """
    env = trainer._accelerator_connector.cluster_environment
    if not isinstance(env, SLURMEnvironment) or not env.auto_requeue or env.requeue_signal is None:
        return
    ours = signal.getsignal(env.requeue_signal)
    if not callable(ours) or threading.current_thread() is not threading.main_thread():
        return
    requeue = trainer._signal_connector._slurm_sigusr_handler_fn

    def both(signum: int, frame: Any) -> None:
        ours(signum, frame)
        requeue(signum, frame)

    signal.signal(env.requeue_signal, both)


class _TrainerState:
    """Lightning's checkpoint dict as one stateful entry of the spotguard checkpoint."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self._dropped: set[str] = set()
        self._metrics: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint[_METRICS] = _callback_metrics(self.trainer)
        if self.trainer.validating or _validates_after(self.trainer):
            _resume_into_validation(checkpoint)
        return {key: value for key, value in checkpoint.items() if self._storable(key, value)}

    def restore_metrics(self) -> None:
        """The callback metrics saved (the last validation's, what the module logged): a
        ``ReduceLROnPlateau``, ``EarlyStopping`` or ``ModelCheckpoint`` monitoring one before it is
        logged again finds it, as in a run never stopped. Lightning's checkpoints hold none."""
        self.trainer._logger_connector._callback_metrics.update(self._metrics)
        self._metrics = {}

    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore through Lightning's own connector, as ``fit(ckpt_path=...)`` would."""
        checkpoint = dict(checkpoint)
        self._metrics = dict(checkpoint.pop(_METRICS, {}))
        connector = self.trainer._checkpoint_connector
        connector._loaded_checkpoint = checkpoint
        try:
            connector.restore_model()
            connector.restore_datamodule()
            connector.restore_callbacks()
            connector.restore_training_state()
        finally:
            connector._loaded_checkpoint = {}

    def _storable(self, key: str, value: Any) -> bool:
        """Whether the pickle-free format stores ``value`` (a dry-run encode; no copy is made)."""
        try:
            encode(value, [], key)
            return True
        except UnsupportedStateError as exc:
            if key not in self._dropped:
                self._dropped.add(key)
                log.warning("not checkpointing Lightning entry %r: %s", key, exc)
            return False
