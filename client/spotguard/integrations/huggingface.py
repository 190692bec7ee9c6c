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
Trainer saves, then leaves its loop (these decisions: :mod:`._hf_stop`; a far notice is logged
once). An advisory notice (AWS rebalance) asks for one early save.
Each save's committed copy is reported to the daemon (``report_commit``) from ``on_save``; at
``on_train_end`` after a stop the daemon is told the process is safe. For the daemon's goodput
figures, as ``Run`` does: a train that starts past step 0 (resumed from a checkpoint) is reported as
a restart from that step at ``on_train_begin`` (``report_resume``, with where the checkpoint came
from: ``bucket`` when :func:`latest_checkpoint` restored it from the store in this launch, ``local``
when it was on disk already, none when the Trainer resumed from a path of neither), and every step
end notes rank 0's progress (``report_progress``: no I/O, the guard's thread sends it every few
seconds). After a stop the process is expected to exit: a guard the callback made is closed as
``Run`` closes it (forced-exit watchdog armed, SIGTERM/SIGUSR1 ignored), so call
:meth:`~SpotguardTrainerCallback.exit_if_stopped` (75) right after ``train``.
An evaluation the Trainer runs at the same step is not part of the measured save duration.

A notice during an evaluation inside ``train()`` is acted on at its next prediction
step (:mod:`._hf_eval`; with several ranks at the next prediction step where they exchange flags,
every N of them as ``Run(agree_at_heartbeat=True)``, so every rank stops there: tested under
``torchrun``, SIGTERM to one rank): the step it follows is saved at once with that step's RNG states (the
Trainer's own ``_save_checkpoint``), and ``train()`` ends with ``SystemExit(75)``; the evaluation's
RNG draws are put back at its end, so it never changes training and such a stop resumes
bit-identically (tested). A far deadline lets the evaluation and training go on. A stop at a step
end skips the evaluation due there (the save comes first). The stop's report to the daemon and
its ``stop`` record carry the step and the save's outcome (``committed``, ``already``, ``no_room``,
``failed``) and times, as ``Run``'s do.

Exact resume: the Trainer itself saves every RNG state (``rng_state.pth``) and, on resume,
reseeds its shuffled sampler per epoch (``accelerator_config.use_seedable_sampler``, the default)
and skips the consumed batches (``ignore_data_skip=False``, the default), so its default shuffled
loader with dropout resumes bit-identically on CPU (tested). Settings that turn either off are
warned about once, at the first save.

Distributed (``torchrun``/``accelerate``): the flags are agreed across ranks with one small
``all_reduce`` at every step end (:class:`spotguard.distributed.Agreement` with interval 1, on its
own gloo group bounded by ``peer_timeout``), so every rank saves once and stops at the step end
right after the notice, even when only one rank received it (tested under ``torchrun`` at 1-3
ranks). As with ``Run``: a notice whose deadline is further away than the save, the margin, one step
and ``stop_lead`` lets training go on; the exchange failing, or no step end for ``peer_timeout``
plus ``PEER_LOST_GRACE`` (an evaluation's prediction steps count as progress; a save is bounded
by ``on_save``'s exchange instead), ends the process
with 77, and so does a peer failure raised out of ``train()`` (DDP's backward usually meets the
lost peer first) that nothing catches (``sys.excepthook``, set while the callback trains).
The gradient bucket layout of the Trainer's DDP (found in its frames) is written beside each
checkpoint as ``spotguard-ddp-layout.json`` and restored on resume (:mod:`spotguard._ddp`), so 3+
ranks resume bit-identically with ``ddp_find_unused_parameters=False`` too.

A finished job relaunched (``spotguard run``, a Slurm requeue, a Kubernetes restart after success):
the Trainer, resuming from a checkpoint at ``max_steps`` mid-epoch, would run one step more before
it looks at ``should_training_stop``. So at ``on_train_begin`` the callback empties the Trainer's
train loader for that call (its batch sampler, put back at ``on_train_end``) and asks it to stop:
nothing is trained or written, and the script goes on after ``train()`` (status 0).

Exceptions: none of its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

from torch.utils.data import DataLoader
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from spotguard import _ddp, _exit, _jobid, _root
from spotguard._console import console, start_line
from spotguard._run_common import fetched_tier, mark_fetched
from spotguard._run_start import fresh_requested
from spotguard._peer import exit_peer_lost_when_uncaught
from spotguard._record import Recorder
from spotguard._run_stop import report_stop, save_outcome
from spotguard._watchdog import Watchdog
from spotguard.checkpoint.layout import CommitInfo
from spotguard.data import ignore_stop_signals
from spotguard.integrations._hf_commit import COMMITTED, NotCommitted, commit_copy, newest_committed
from spotguard.integrations._hf_eval import EvalPause
from spotguard.integrations._hf_record import TrainerRecord
from spotguard.integrations._hf_stop import StopDecisions
from spotguard.distributed import Agreement
from spotguard.exit_codes import EXIT_PEER_LOST, EXIT_PREEMPTED
from spotguard.guard import DEFAULT_SIGNAL_DEADLINES, Guard
from spotguard.protocol import utcnow
from spotguard.run import PEER_LOST_GRACE
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
    ``$SPOTGUARD_STORAGE__URL``) and holds a newer checkpoint of ``job_id`` (the callback's: given,
    else ``$SPOTGUARD_JOB_ID``, else derived from the command line and working directory, as the
    callback derives it) than the local copies, it is restored into ``output_dir/spotguard`` first
    (local rank 0 only). An unreachable store is logged and the local checkpoints are used.

    ``$SPOTGUARD_FRESH=1`` starts over: the Trainer's ``checkpoint-N`` directories and their
    committed copies under ``output_dir`` are removed (local rank 0), and None is returned."""
    root = Path(output_dir)
    if fresh_requested(None):
        _start_fresh(root)
        return None
    url, options = store_from_env()
    url = store or url
    if url and os.environ.get("LOCAL_RANK", "0") == "0":
        try:
            restored = restore_newer(root / COMMITTED, _jobid.resolve(job_id)[0], url, options)
            if restored is not None:  # the callback reports where its resumed step came from
                mark_fetched(restored, "bucket")
        except (StoreError, OSError) as exc:
            log.warning("could not restore from %s (%s); going on with local checkpoints", url, exc)
    copy = newest_committed(root / COMMITTED, _STATE_FILE)
    found = [] if copy is None else [(copy[0], 0, copy[1])]  # the Trainer's own wins a tie
    for path in root.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        suffix = path.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if suffix.isdigit() and (path / _STATE_FILE).is_file():
            found.append((int(suffix), 1, path))
    return str(max(found)[2]) if found else None


def _start_fresh(root: Path) -> None:
    """``$SPOTGUARD_FRESH=1``: remove the Trainer's checkpoints and their committed copies (local rank 0)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    found = [p for p in root.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir()]
    found += [root / COMMITTED] if (root / COMMITTED).is_dir() else []
    for path in found:
        shutil.rmtree(path)
    if found:
        log.warning("starting fresh: removed %d checkpoint(s) under %s", len(found), root)


class SpotguardTrainerCallback(StopDecisions, TrainerCallback):
    """Stops a ``Trainer`` cleanly on a notice; see the module docstring.

    ``guard``: a :class:`~spotguard.Guard` to use (the caller closes it), else one is made at
    ``on_train_begin`` from ``job_id``, ``daemon`` and ``signal_deadlines`` and closed at
    ``on_train_end``. ``save_margin``: seconds kept free between the save's end and the deadline;
    ``stop_lead``: :class:`~spotguard.Run`'s (a notice whose deadline is further away than the
    save, the margin, a step and ``stop_lead`` lets training go on). ``peer_timeout``: ``Run``'s
    (the ranks' exchange gives up after that long, and a rank that reaches no step end for that
    long plus ``PEER_LOST_GRACE`` exits 77). ``durable``: commit a copy of each save in
    spotguard's layout and report that to the daemon (which uploads it); None (default): when a
    durable store is known at ``on_train_begin`` (``$SPOTGUARD_STORAGE__URL`` or the daemon's
    ``status``). ``agree_in_evaluation`` (several ranks): the ranks agree on a notice at the
    prediction steps of an evaluation inside ``train()``; every rank must then evaluate the same
    number of batches (Accelerate's ``even_batches`` does); off: a notice waits for the next step end.

    :param job_id: The job's id in the daemon and the durable store.
    :param daemon: Listen to the node's daemon; False: signals only.
    :param save_margin: Seconds kept free between the save's end and the deadline.
    :param stop_lead: Seconds before the latest safe stop at which a far-off notice stops.
    :param peer_timeout: Seconds after which a lost peer rank ends the process with 77 (None: off).
    :param signal_deadlines: Seconds from each stop signal to the kill (None: no deadline).
    :param guard: A :class:`~spotguard.Guard` to use (the caller closes it).
    :param durable: Commit a copy of each save in spotguard's layout for the daemon to upload (None:
        when a durable store is known).
    :param agree_in_evaluation: With several ranks, agree on a notice during an evaluation inside
        ``train()``.
    """

    def __init__(self, *, job_id: str = "", daemon: bool = True, save_margin: float = 2.0,
                 stop_lead: float = 60.0, peer_timeout: float | None = 600.0,
                 signal_deadlines: Mapping[int, float | None] = DEFAULT_SIGNAL_DEADLINES,
                 guard: Guard | None = None, durable: bool | None = None,
                 agree_in_evaluation: bool = True) -> None:
        if stop_lead < 0:
            raise ValueError("stop_lead must be >= 0")
        self._guard_kwargs = dict(daemon=daemon, signal_deadlines=signal_deadlines)
        self._given_job = job_id
        self.job_id = ""
        """The job's id, from ``on_train_begin``: ``job_id=`` (or the guard's), else
        ``$SPOTGUARD_JOB_ID``, else derived from the command line and working directory as ``Run``
        derives it (rank 0's on every rank): two jobs sharing a store never share checkpoints."""
        self.guard = guard
        self._own_guard = guard is None
        self.save_margin, self.stop_lead, self.peer_timeout = save_margin, stop_lead, peer_timeout
        self.agreement: Agreement | None = None
        self.agree_in_evaluation = agree_in_evaluation
        self._eval_agreement: Agreement | None = None  # several ranks: at prediction steps (_hf_stop)
        self._eval_count = 0
        self.stopped = False
        self.save_seconds: float | None = None
        self._save_started: float | None = None
        self._checked = False
        self.durable = durable
        self._record = Recorder()
        self._trace = TrainerRecord(self._record)  # the run record, for spotguard drill and run
        self._progress: Watchdog | None = None
        self._last_end: float | None = None
        self._step_seconds = 0.0
        self._far_notices: set[str] = set()  # the far notices already logged
        self._drained: tuple[Any, Any] | None = None
        self._last_step = 0
        self._unhook: Any = None
        self._layouts: _ddp.Layouts | None = None
        self._pause = EvalPause()  # an evaluation inside train(): what a stop during it saves
        self._stop_report: dict[str, Any] | None = None
        """The stop's side of the notice timeline (:class:`~spotguard.protocol.SafeRequest`'s fields)."""
        self._saved_step: int | None = None
        self._root_lock: tuple[int, int] | None = None
        """``output_dir``'s lock (:mod:`spotguard._root`), from ``on_train_begin`` to ``on_train_end``."""

    def exit_if_stopped(self) -> None:
        """Raise ``SystemExit(EXIT_PREEMPTED)`` (75) when training stopped because of a notice."""
        if self.stopped:
            raise _exit.stop_exit(EXIT_PREEMPTED)  # a SystemExit that also exits promptly

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.stopped, self._stop_report, self._saved_step = False, None, None
        _keep_workers(kwargs.get("train_dataloader"))
        job, given = _jobid.resolve(self._given_job or getattr(self.guard, "job_id", ""))
        self.job_id = _jobid.agree(job, given=given)  # rank 0's on every rank
        if state.is_world_process_zero and self._root_lock is None:  # the process that saves: as Run
            root = Path(args.output_dir).absolute()
            root.mkdir(parents=True, exist_ok=True)
            _root.probe(root)
            self._root_lock = _root.hold(root, self.job_id)
        if self.guard is None:
            self.guard = Guard(rank=args.process_index, job_id=self.job_id, **self._guard_kwargs)
        self._record = Recorder(rank=args.process_index, job=self.job_id)
        # Made here, not in __init__: torch.distributed runs by now, so the exchange gets its own
        # group bounded by peer_timeout. Interval 1: a stop comes at the step end after the notice.
        self.agreement = Agreement(timeout=self.peer_timeout, max_interval=1)
        enabled = self.agreement.enabled and self.agree_in_evaluation
        self._eval_agreement = Agreement(share=self.agreement) if enabled else None
        if self.peer_timeout and self.agreement.enabled:
            stalled = (f"no step end for {self.peer_timeout} s (peer_timeout=): a peer rank is probably "
                       "gone")
            self._progress = Watchdog(EXIT_PEER_LOST, stalled, before_exit=lambda: self._record.emit(
                "peer_lost", step=self._last_step, error=stalled))
            self._unhook = exit_peer_lost_when_uncaught(self._record, lambda: self._last_step)
        if self.durable is None:
            store = ((self.guard.daemon_status() or {}).get("uploads") or {}).get("store")
            self.durable = bool(store_from_env()[0] or store)
        self._last_step = state.global_step
        self._trace = TrainerRecord(self._record)
        self._trace.begin(args, state)
        self._layouts = _ddp.trainer_layouts(kwargs.get("model"), _resumed_dirs(args, state))  # DDP's buckets
        if state.global_step > 0:  # the Trainer loaded a checkpoint's state before this event
            log.info("resumed from step %d", state.global_step)
            self.guard.report_resume(state.global_step, _resumed_tier(args, state))
        if state.is_world_process_zero:
            resumed = _resumed_dirs(args, state)
            console.info("%s", start_line(self.job_id, state.global_step, None if not resumed else
                                          next((p for p in resumed if p.is_dir()), resumed[0]), None, None))
        if 0 < state.max_steps <= state.global_step:
            log.info("already finished: step %d of %d is saved; nothing to run", state.global_step,
                     state.max_steps)
            self._drained = _drain(kwargs.get("train_dataloader"))
            control.should_training_stop = True

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """The step boundary: agree on the flags, then ask for a save and a stop as needed."""
        if self.guard is None or self.stopped:
            return
        step = self._last_step = state.global_step
        self._observe_step()
        self._record.progress(step)
        self.guard.report_progress(step)
        assert self.agreement is not None
        if not self.agreement.enabled or self.agreement.due(step):
            self._decide(step, control, kwargs)
        if self.stopped:
            control.should_evaluate = False  # the save first: an evaluation now could outlast the deadline
        elif control.should_evaluate and self._pauses():
            self._pause.begin(step)
        if control.should_save:  # ours or the Trainer's schedule: time it until on_save
            self._save_started = time.monotonic()
            if self._progress is not None:  # a long save is not a lost peer: on_save's barrier is bounded
                self._progress.disarm()

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if control.should_evaluate and not self.stopped and self._pauses():  # an epoch strategy's evaluation
            self._pause.begin(state.global_step)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._pause.clear()

    def on_prediction_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                           **kwargs: Any) -> None:
        """An evaluation between two steps is not a lost peer; a notice during one inside
        ``train()`` stops there (:mod:`._hf_eval`)."""
        if self._progress is not None and self._progress.armed_at is not None:
            self._arm_progress()
        if not self._pause.active or self.guard is None or self.stopped:
            return
        if self._eval_agreement is not None:  # several ranks: they agree here every N prediction steps
            self._agree_in_evaluation(args, state, control, kwargs)
        elif self.guard.stop_requested:
            self._stop_in_evaluation(args, state, control, kwargs)

    def _pauses(self) -> bool:
        """Whether a notice during an evaluation inside ``train()`` is acted on there (one process,
        or several that agree at its prediction steps)."""
        return self.agreement is not None and (not self.agreement.enabled or self._eval_agreement is not None)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Put back the RNG states of the evaluation's start: it draws nothing training sees. A
        save due at this step is timed from here (the evaluation is not part of its duration)."""
        self._pause.put_back()
        if self._save_started is not None:
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
        if self.agreement is not None:
            self._collective(lambda: self.agreement.barrier(state.global_step), state.global_step)
        if self._progress is not None and not self.stopped:
            self._arm_progress()
        self._saved_step = state.global_step
        stop = self._stop_report
        if stop is not None and stop["step"] == state.global_step:
            stop["committed_at"] = utcnow()
        self._trace.saved(state, path, self.save_seconds, kwargs, "periodic" if stop is None else "emergency")
        if self.guard is not None and self.durable and state.is_world_process_zero and path.is_dir():
            self._commit(state, path)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """After a stop, tell the daemon the process is safe; close a guard of our own."""
        self._pause.clear()
        if not self.stopped and self._drained is None:
            self._trace.end(state, kwargs)
        if self._progress is not None:
            self._progress.disarm()
        if self._unhook is not None:
            self._unhook()
            self._unhook = None
        if self._drained is not None:
            _undrain(*self._drained)
            self._drained = None
        _root.release(self._root_lock)
        self._root_lock = None
        if self.guard is None:
            return
        if self.stopped and self._stop_report is not None:
            stop, self._stop_report = self._stop_report, None
            saved = stop["committed_at"] is not None
            stop["save"] = save_outcome(stop.pop("already"), saved, stop.pop("fits"))
            report_stop(self.guard, self._record, stop, saved)
        if self._own_guard:
            self.guard.close(exiting=self.stopped)
            self.guard = None

    def _commit(self, state: TrainerState, path: Path) -> None:
        """Commit a copy of ``path`` in spotguard's layout and report it (the daemon uploads only
        that layout); a checkpoint that cannot be copied safely is logged, training goes on."""
        assert self.guard is not None
        try:
            copy = commit_copy(path, path.parent / COMMITTED, state.global_step, self.job_id)
        except (NotCommitted, OSError) as exc:
            log.warning("checkpoint %s not committed for upload: %s", path, exc)
            return
        self.guard.report_commit(_commit_info(state, copy))

    def _observe_step(self) -> None:
        """Measure the step time (for the far-deadline rule) and push the peer-loss bound on."""
        now = time.monotonic()
        if self._last_end is not None:
            self._step_seconds = now - self._last_end
        self._last_end = now
        if self._progress is not None:
            self._arm_progress()

    def _arm_progress(self) -> None:
        assert self._progress is not None and self.peer_timeout
        self._progress.reset(time.monotonic() + self.peer_timeout + PEER_LOST_GRACE)


def _keep_workers(loader: Any) -> None:
    """The train loader's workers ignore SIGTERM and SIGINT (torchrun's ``killpg`` reaches them);
    its epochs' iterators are made after ``on_train_begin``. Nothing it draws changes."""
    base = getattr(loader, "base_dataloader", loader)  # Accelerate's DataLoaderShard wraps one
    if isinstance(base, DataLoader):
        ignore_stop_signals(base)


def _drain(loader: Any) -> tuple[Any, Any] | None:
    """Make the Trainer's train loader yield no batch (a finished job relaunched: the Trainer would
    otherwise run one step past ``max_steps`` before it looks at ``should_training_stop``).
    Returns what :func:`_undrain` needs to put it back; None when there is nothing to drain."""
    base = getattr(loader, "base_dataloader", loader)  # Accelerate's DataLoaderShard wraps one
    if base is None or getattr(base, "batch_sampler", None) is None:
        return None
    original = base.batch_sampler
    object.__setattr__(base, "batch_sampler", ())  # DataLoader refuses a plain set after init
    return base, original


def _undrain(base: Any, batch_sampler: Any) -> None:
    object.__setattr__(base, "batch_sampler", batch_sampler)


def _resumed_dirs(args: TrainingArguments, state: TrainerState) -> list[Path]:
    """Where the checkpoint the Trainer resumed from may be (a ``checkpoint-N`` or its committed
    copy); none for a fresh start."""
    if state.global_step == 0:
        return []
    root = Path(args.output_dir)
    return [root / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", root / COMMITTED / step_name(state.global_step)]


def _resumed_tier(args: TrainingArguments, state: TrainerState) -> str | None:
    """Where the checkpoint resumed from came from: ``bucket`` when :func:`latest_checkpoint`
    restored it in this launch, ``local`` when it was on this node's disk already; None when none
    of :func:`_resumed_dirs` exists (the Trainer resumed from another path)."""
    found = next((p for p in _resumed_dirs(args, state) if p.is_dir()), None)
    return None if found is None else fetched_tier(found) or "local"


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


def _commit_info(state: TrainerState, path: Path) -> CommitInfo:
    files = [p for p in path.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    epoch = int(state.epoch) if state.epoch is not None else None
    return CommitInfo(state.global_step, epoch, path, size, len(files), time.time())
