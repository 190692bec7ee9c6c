"""The stop decisions of the Hugging Face ``Trainer`` callback (:mod:`.huggingface`).

:class:`StopDecisions` is the part of
:class:`~spotguard.integrations.huggingface.SpotguardTrainerCallback` that decides, at a step end
(``_decide``, after the ranks' exchange) or at a prediction step of an evaluation inside ``train()``
(``_stop_in_evaluation``, :mod:`._hf_eval`), whether a notice stops training: ``Run``'s
far-deadline rule (``stop_lead``; a far notice is logged once per notice), whether a save fits
before the deadline (:func:`spotguard.run.save_fits`), and the stop's report that ``on_save`` and
``on_train_end`` complete. It is a mixin: it works on the callback's attributes (``guard``,
``agreement``, ``save_margin``, ``stop_lead``, ``stopped``, ``save_seconds`` and the private state
the callback's ``__init__`` sets) and ends a stop during an evaluation with the callback's
``on_train_end``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from transformers import TrainerControl, TrainerState, TrainingArguments

from spotguard import _exit
from spotguard._heartbeat import HeartbeatMismatch
from spotguard._peer import exit_peer_lost
from spotguard._run_stop import note_far_notice, secs
from spotguard.distributed import Decision, PeerLostError
from spotguard.exit_codes import EXIT_PREEMPTED
from spotguard.integrations._hf_eval import calling_trainer
from spotguard.protocol import utcnow
from spotguard.run import ASSUMED_THROUGHPUT, save_fits

__all__ = ["StopDecisions"]

log = logging.getLogger("spotguard.integrations.huggingface")


class StopDecisions:
    """Whether and how a notice stops the ``Trainer`` (see the module docstring)."""


    def _decide(self, step: int, control: TrainerControl, kwargs: Mapping[str, Any]) -> None:
        assert self.agreement is not None and self.guard is not None
        local = self._local_decision(kwargs)
        decision = self._collective(lambda: self.agreement.agree(step, local), step)
        if decision.stop:
            self._stop(step, decision, control)
        elif decision.checkpoint:
            control.should_save = True
            self.guard.clear_checkpoint_request()

    def _collective(self, exchange: Any, step: int) -> Any:
        """Run one exchange of the ranks; a peer that is gone ends this process with 77."""
        try:
            return exchange()
        except PeerLostError as exc:
            exit_peer_lost(exc, self._record, step)

    def _local_decision(self, kwargs: Mapping[str, Any]) -> Decision:
        assert self.guard is not None
        stop = self.guard.stop_requested
        left = self.guard.seconds_left() if stop else None
        save = self._expected_save_seconds(kwargs) if stop else None
        if stop and left is not None and left > self._stop_needed(save):
            self._note_far_notice(left, save)
            stop = False
        return Decision(stop=stop, checkpoint=self.guard.checkpoint_requested,
                        seconds_left=left if stop else None, save_seconds=save if stop else None)

    def _stop_needed(self, save_seconds: float | None) -> float:
        """Seconds before a deadline at which training must stop (``Run``'s rule): the expected
        save, the margin, one step and ``stop_lead``."""
        return (save_seconds or 0.0) + self.save_margin + self._step_seconds + self.stop_lead

    def _note_far_notice(self, left: float, save: float | None) -> None:
        """Say once per notice that its deadline is far and training goes on (the step-end and
        the evaluation paths both ask)."""
        assert self.guard is not None
        note_far_notice(log, self.guard.notice, self._far_notices, left, self._stop_needed(save))

    def _begin_stop(self, step: int, decision: Decision, scheduled: bool = False) -> bool:
        """Start a stop at ``step``: whether a save is to be asked for (it fits before the deadline,
        and ``step`` is neither saved nor ``scheduled`` to be); ``on_save`` and ``on_train_end``
        complete the stop's report."""
        assert self.guard is not None
        if self._progress is not None:
            self._progress.disarm()  # the notice's forced-exit watchdog bounds the stop
        self.guard.begin_stop()
        already = self._saved_step == step
        left = decision.seconds_left
        fits = already or scheduled or save_fits(decision.save_seconds, left, self.save_margin)
        self._stop_report = {"step": step, "stopped_at": utcnow(), "estimate_s": decision.save_seconds,
                             "seconds_left": left, "committed_at": None, "already": already, "fits": fits}
        self.stopped = True
        if not fits:
            log.warning("stopping at step %d without a save (%s needed with save_margin=%.1f s; %s): the "
                        "last checkpoint stands", step, secs(decision.save_seconds), self.save_margin,
                        _describe(left))
        return fits and not already and not scheduled

    def _stop(self, step: int, decision: Decision, control: TrainerControl) -> None:
        if self._begin_stop(step, decision, scheduled=bool(control.should_save)):
            log.warning("stopping at step %d: asking the Trainer for a save (about %.2f s; %s)",
                        step, decision.save_seconds or 0.0, _describe(decision.seconds_left))
            control.should_save = True
        elif control.should_save:
            log.warning("stopping at step %d after the scheduled save", step)
        control.should_training_stop = True

    def _agree_in_evaluation(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                             kwargs: Mapping[str, Any]) -> None:
        """Several ranks, at a prediction step of an evaluation inside ``train()``: every N of them
        (N adapted as ``Run(agree_at_heartbeat=True)``'s) the ranks exchange their flags, with the
        prediction step's number and the step the evaluation follows as marks; a stop agreed there
        saves that step on every rank (the Trainer's save runs on every rank, as at a step end)."""
        assert self._eval_agreement is not None
        self._eval_count += 1
        if not self._eval_agreement.due(self._eval_count):
            return
        local = self._local_decision(kwargs)
        marks = (self._eval_count, self._pause.step)
        decision = self._collective(lambda: self._eval_agreement.agree(self._eval_count, local, marks),
                                    state.global_step)
        if not all(decision.marks_equal):
            raise HeartbeatMismatch(f"SpotguardTrainerCallback: at prediction step {self._eval_count} of an "
                                    "evaluation inside train() the ranks were at different prediction steps; "
                                    "every rank must evaluate the same number of batches, or pass "
                                    "agree_in_evaluation=False")
        if decision.stop:
            self._stop_in_evaluation(args, state, control, kwargs, decision)

    def _stop_in_evaluation(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                            kwargs: Mapping[str, Any], agreed: Decision | None = None) -> None:
        """A notice during an evaluation inside ``train()`` (the far-deadline rule as at a step end;
        ``agreed``: the ranks' decision): save the step it follows with that step's RNG states, at
        once, then end ``train()`` with ``SystemExit(75)`` (:mod:`._hf_eval`)."""
        decision = agreed or self._local_decision(kwargs)
        trainer = calling_trainer() if decision.stop else None
        if trainer is None:
            return  # a far deadline (or no Trainer to save with): the next step end decides
        step = self._pause.step
        assert step is not None and step == state.global_step
        log.warning("spotguard stops during the evaluation after step %d", step)
        self._pause.put_back()  # what the save writes: the step's RNG, not the evaluation's draws
        self._pause.clear()
        if self._begin_stop(step, decision):
            log.warning("stopping at step %d: emergency save during the evaluation (about %.2f s; %s)",
                        step, decision.save_seconds or 0.0, _describe(decision.seconds_left))
            self._save_started = time.monotonic()
            try:
                trainer._save_checkpoint(trainer.model_wrapped, trial=None)
                trainer.control = trainer.callback_handler.on_save(args, state, trainer.control)
            except Exception as exc:  # noqa: BLE001  # the last checkpoint stands: stop anyway
                log.error("the emergency save failed (%s); the last checkpoint stands", exc)
        self.on_train_end(args, state, control, **kwargs)  # the safe report, the record, the guard
        raise _exit.stop_exit(EXIT_PREEMPTED)  # out of train(): the script exits 75

    def _expected_save_seconds(self, kwargs: Mapping[str, Any]) -> float | None:
        """The last save's measured duration, else model + optimizer bytes at an assumed speed."""
        if self.save_seconds is not None:
            return self.save_seconds
        size = _tensor_bytes(kwargs.get("model")) + _tensor_bytes(kwargs.get("optimizer"))
        return size / ASSUMED_THROUGHPUT if size else None


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
