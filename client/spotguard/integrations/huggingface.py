"""A Hugging Face ``Trainer`` callback: save and stop cleanly on an interruption notice.

::

    from spotguard.integrations.huggingface import SpotguardTrainerCallback, latest_checkpoint

    guard = SpotguardTrainerCallback()
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[guard])
    trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))
    guard.exit_if_stopped()               # SystemExit(75) after a notice: requeue the job

Checkpoints are the Trainer's own: it writes ``<output_dir>/checkpoint-<global_step>`` directories
(model, optimizer, scheduler, scaler, RNG and ``trainer_state.json``) on its ``save_steps``
schedule, and ``trainer.train(resume_from_checkpoint=...)`` resumes from one. spotguard does not
make those writes atomic: a save cut off by the kill leaves a partial directory.
:func:`latest_checkpoint` therefore returns the newest directory that holds ``trainer_state.json``,
the file the Trainer writes after the model, optimizer and RNG states (``None`` for a fresh start,
where ``resume_from_checkpoint=True`` would raise).

Durable copies: the daemon uploads only spotguard's committed ``step-NNNNNNNNNN`` layout, so with a
durable store (``durable=``, else one known at ``on_train_begin``) each finished ``checkpoint-N`` is
copied into ``<output_dir>/spotguard`` in that layout (:mod:`._hf_commit`) and the copy is reported.
On a fresh node :func:`latest_checkpoint` restores the store's newest copy first when it is newer
than everything local, and the Trainer resumes from it (tested end to end, bit-identical).

At every step end (``on_step_end``, after the optimizer step) the callback asks its
:class:`~spotguard.Guard` (daemon notices, SIGTERM, SIGUSR1). On a stopping notice it sets
``control.should_save`` when a save fits before the deadline (:func:`spotguard.run.save_fits`: the
duration of the Trainer's last save, measured from ``on_step_end`` to ``on_save``, or before any
save an estimate from the model and optimizer bytes), and ``control.should_training_stop``; the
Trainer saves, then leaves its loop. An advisory notice (AWS rebalance) asks for one early save.
Each save's committed copy is reported to the daemon (``report_commit``) from ``on_save``; at ``on_train_end`` after
a stop the daemon is told the process is safe. For the daemon's goodput figures, as ``Run`` does: a
train that starts past step 0 (resumed from a checkpoint) is reported as a restart from that step at
``on_train_begin`` (``report_resume``), and every step end notes rank 0's progress
(``report_progress``: no I/O, the guard's thread sends it every few seconds). After a stop the process is expected to exit: a
guard the callback made is closed as ``Run`` closes it (forced-exit watchdog armed, SIGTERM/SIGUSR1
ignored), so call :meth:`~SpotguardTrainerCallback.exit_if_stopped` (75) right after ``train``.
The measured save duration includes an evaluation the Trainer runs at the same step, if any.

Exact resume: the Trainer itself saves every RNG state (``rng_state.pth``) and, on resume,
reseeds its shuffled sampler per epoch (``accelerator_config.use_seedable_sampler``, the default)
and skips the consumed batches (``ignore_data_skip=False``, the default), so its default shuffled
loader with dropout resumes bit-identically on CPU (tested). Settings that turn either off are
warned about once, at the first save.

Distributed (``torchrun``/``accelerate``): the flags are agreed across ranks with one
``all_reduce`` (:class:`spotguard.distributed.Agreement`), so every rank saves and stops at the
same step even when only one received the notice (not tested across processes yet).

Exceptions: none of its own.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from spotguard import _ddp, _exit
from spotguard.checkpoint.layout import CommitInfo
from spotguard.integrations._hf_commit import COMMITTED, NotCommitted, commit_copy, newest_committed
from spotguard.distributed import Agreement, Decision
from spotguard.exit_codes import EXIT_PREEMPTED
from spotguard.guard import DEFAULT_SIGNAL_DEADLINES, Guard
from spotguard.run import ASSUMED_THROUGHPUT, save_fits
from spotguard.storage import StoreError, restore_newer, store_from_env
from spotguard.storage._local import step_name

__all__ = ["SpotguardTrainerCallback", "latest_checkpoint"]

log = logging.getLogger(__name__)

_STATE_FILE = "trainer_state.json"


def latest_checkpoint(output_dir: str | os.PathLike[str], *, job_id: str = "",
                      store: str | None = None) -> str | None:
    """The newest complete checkpoint under ``output_dir``: a ``checkpoint-N`` directory or a
    committed copy in ``output_dir/spotguard``; None if there is none.

    The fresh-node case: when a durable store is known (``store``, else
    ``$SPOTGUARD_STORAGE__URL``) and holds a newer checkpoint of ``job_id`` (the callback's) than
    the local copies, it is restored into ``output_dir/spotguard`` first (local rank 0 only). An
    unreachable store is logged and the local checkpoints are used."""
    root = Path(output_dir)
    url, options = store_from_env()
    url = store or url
    if url and os.environ.get("LOCAL_RANK", "0") == "0":
        try:
            restore_newer(root / COMMITTED, job_id, url, options)
        except (StoreError, OSError) as exc:
            log.warning("could not restore from %s (%s); going on with local checkpoints", url, exc)
    copy = newest_committed(root / COMMITTED, _STATE_FILE)
    found = [] if copy is None else [(copy[0], 0, copy[1])]  # the Trainer's own wins a tie
    for path in root.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        suffix = path.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if suffix.isdigit() and (path / _STATE_FILE).is_file():
            found.append((int(suffix), 1, path))
    return str(max(found)[2]) if found else None


class SpotguardTrainerCallback(TrainerCallback):
    """Stops a ``Trainer`` cleanly on a notice; see the module docstring.

    ``guard``: a :class:`~spotguard.Guard` to use (the caller closes it), else one is made at
    ``on_train_begin`` from ``job_id``, ``daemon`` and ``signal_deadlines`` and closed at
    ``on_train_end``. ``save_margin``: seconds kept free between the save's end and the deadline.
    ``durable``: commit a copy of each save in spotguard's layout and report that to the daemon
    (which uploads it); None (default): when a durable store is known at ``on_train_begin``
    (``$SPOTGUARD_STORAGE__URL`` or the daemon's ``status``).
    """

    def __init__(self, *, job_id: str = "", daemon: bool = True, save_margin: float = 2.0,
                 signal_deadlines: Mapping[int, float | None] = DEFAULT_SIGNAL_DEADLINES,
                 guard: Guard | None = None, durable: bool | None = None) -> None:
        self._guard_kwargs = dict(job_id=job_id, daemon=daemon, signal_deadlines=signal_deadlines)
        self.guard = guard
        self._own_guard = guard is None
        self.save_margin = save_margin
        self.agreement = Agreement()
        self.stopped = False
        self.save_seconds: float | None = None
        self._save_started: float | None = None
        self._checked = False
        self.durable = durable
        self._layouts: _ddp.Layouts | None = None

    def exit_if_stopped(self) -> None:
        """Raise ``SystemExit(EXIT_PREEMPTED)`` (75) when training stopped because of a notice."""
        if self.stopped:
            raise _exit.stop_exit(EXIT_PREEMPTED)  # a SystemExit that also exits promptly

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.stopped = False
        if self.guard is None:
            self.guard = Guard(rank=args.process_index, **self._guard_kwargs)
        if self.durable is None:
            store = ((self.guard.daemon_status() or {}).get("uploads") or {}).get("store")
            self.durable = bool(store_from_env()[0] or store)
        self._layouts = _ddp.trainer_layouts(kwargs.get("model"), _resumed_dirs(args, state))  # DDP's buckets
        if state.global_step > 0:  # the Trainer loaded a checkpoint's state before this event
            log.info("resumed from step %d", state.global_step)
            self.guard.report_resume(state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """The step boundary: agree on the flags, then ask for a save and a stop as needed."""
        if self.guard is None or self.stopped:
            return
        step = state.global_step
        self.guard.report_progress(step)
        if not self.agreement.enabled or self.agreement.due(step):
            self._decide(step, control, kwargs)
        if control.should_save:  # ours or the Trainer's schedule: time it until on_save
            self._save_started = time.monotonic()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """The Trainer wrote ``checkpoint-<global_step>``: time it and report it to the daemon."""
        if not self._checked:
            self._checked = True
            _warn_inexact(args)
        if self._save_started is not None:
            self.save_seconds = time.monotonic() - self._save_started
            self._save_started = None
        path = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        # The Trainer calls on_save on each rank as soon as that rank has written its part (its
        # rng_state_<rank>.pth among them), with no barrier: rank 0 copies only once all have. Every
        # rank takes part, whatever its own settings say, or a mismatch would hang the others.
        if self._layouts is not None:  # every rank; rank 0 writes DDP's bucket layout beside the files
            self._layouts.save_beside(path, state.is_world_process_zero)
        self.agreement.barrier(state.global_step)
        if self.guard is not None and self.durable and state.is_world_process_zero and path.is_dir():
            self._commit(state, path)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """After a stop, tell the daemon the process is safe; close a guard of our own."""
        if self.guard is None:
            return
        if self.stopped:
            self.guard.report_safe()
        if self._own_guard:
            self.guard.close(exiting=self.stopped)
            self.guard = None

    def _commit(self, state: TrainerState, path: Path) -> None:
        """Commit a copy of ``path`` in spotguard's layout and report it (the daemon uploads only
        that layout); a checkpoint that cannot be copied safely is logged, training goes on."""
        assert self.guard is not None
        try:
            copy = commit_copy(path, path.parent / COMMITTED, state.global_step, self.guard.job_id)
        except (NotCommitted, OSError) as exc:
            log.warning("checkpoint %s not committed for upload: %s", path, exc)
            return
        self.guard.report_commit(_commit_info(state, copy))

    # ------------------------------------------------------------------ decisions

    def _decide(self, step: int, control: TrainerControl, kwargs: Mapping[str, Any]) -> None:
        decision = self.agreement.agree(step, self._local_decision(kwargs))
        if decision.stop:
            self._stop(step, decision, control)
        elif decision.checkpoint:
            control.should_save = True
            self.guard.clear_checkpoint_request()

    def _local_decision(self, kwargs: Mapping[str, Any]) -> Decision:
        assert self.guard is not None
        stop = self.guard.stop_requested
        return Decision(stop=stop, checkpoint=self.guard.checkpoint_requested,
                        seconds_left=self.guard.seconds_left() if stop else None,
                        save_seconds=self._expected_save_seconds(kwargs) if stop else None)

    def _stop(self, step: int, decision: Decision, control: TrainerControl) -> None:
        assert self.guard is not None
        self.guard.begin_stop()
        left = decision.seconds_left
        if control.should_save:
            log.warning("stopping at step %d after the scheduled save", step)
        elif save_fits(decision.save_seconds, left, self.save_margin):
            log.warning("stopping at step %d: asking the Trainer for a save (about %.2f s; %s)",
                        step, decision.save_seconds or 0.0, _describe(left))
            control.should_save = True
        else:
            log.warning("stopping at step %d without a save (%s s needed; %s): the last checkpoint "
                        "stands", step, decision.save_seconds, _describe(left))
        control.should_training_stop = True
        self.stopped = True

    def _expected_save_seconds(self, kwargs: Mapping[str, Any]) -> float | None:
        """The last save's measured duration, else model + optimizer bytes at an assumed speed."""
        if self.save_seconds is not None:
            return self.save_seconds
        size = _tensor_bytes(kwargs.get("model")) + _tensor_bytes(kwargs.get("optimizer"))
        return size / ASSUMED_THROUGHPUT if size else None


def _resumed_dirs(args: TrainingArguments, state: TrainerState) -> list[Path]:
    """Where the checkpoint the Trainer resumed from may be (a ``checkpoint-N`` or its committed
    copy); none for a fresh start."""
    if state.global_step == 0:
        return []
    root = Path(args.output_dir)
    return [root / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", root / COMMITTED / step_name(state.global_step)]


def _warn_inexact(args: TrainingArguments) -> None:
    """Warn once about settings with which a resumed run leaves the uninterrupted trajectory."""
    if args.ignore_data_skip:
        log.warning("resume will not be bit-identical: ignore_data_skip=True restarts the epoch "
                    "from its first batch; leave it False")
    config = getattr(args, "accelerator_config", None)
    if config is not None and not getattr(config, "use_seedable_sampler", True):
        log.warning("resume will not be bit-identical: use_seedable_sampler=False draws the "
                    "shuffle from the global RNG; leave accelerator_config.use_seedable_sampler "
                    "True")


def _describe(left: float | None) -> str:
    return "no deadline" if left is None else f"{left:.1f} s left"


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj.state_dict()`` (one level of nesting: optimizer state)."""
    if obj is None or not hasattr(obj, "state_dict"):
        return 0
    total, stack = 0, [obj.state_dict()]
    while stack:
        value = stack.pop()
        if hasattr(value, "element_size"):
            total += value.element_size() * value.nelement()
        elif isinstance(value, Mapping):
            stack.extend(value.values())
    return total


def _commit_info(state: TrainerState, path: Path) -> CommitInfo:
    files = [p for p in path.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    epoch = int(state.epoch) if state.epoch is not None else None
    return CommitInfo(state.global_step, epoch, path, size, len(files), time.time())
