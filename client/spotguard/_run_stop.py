"""How a :class:`spotguard.run.Run` stops on a notice: the far-deadline rule, the emergency save when
it fits before the deadline, the report to the daemon and the record, and the exit (75)."""

from __future__ import annotations

import logging
import os
from typing import Any

from spotguard import _exit
from spotguard._console import console
from spotguard._record import stop_times
from spotguard._run_parts import rank
from spotguard._worker_signals import worker_errors_deferred
from spotguard.checkpoint import CheckpointError
from spotguard.distributed import Decision
from spotguard.exit_codes import EXIT_PREEMPTED
from spotguard.protocol import utcnow

__all__ = ["Stopping", "note_far_notice", "report_stop", "save_fits", "save_outcome", "secs"]

log = logging.getLogger("spotguard.run")


def _from_loader(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in torch's DataLoader (a worker died, its pipe broke), or by its
    SIGCHLD handler, which raises wherever the main thread is when a worker dies."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_TORCH_LOADER_FILES):
            return True
        tb = tb.tb_next
    return False


_TORCH_LOADER_FILES = (os.path.join("torch", "utils", "data", "dataloader.py"),
                 os.path.join("torch", "utils", "data", "_utils", "signal_handling.py"))


def save_fits(save_seconds: float | None, seconds_left: float | None, margin: float) -> bool:
    """Whether an emergency save of ``save_seconds`` fits before a deadline ``seconds_left`` away.

    No deadline: it fits (the forced-exit watchdog still bounds it). Unknown duration: it does not,
    because a save cut off by the kill costs the time and leaves nothing newer than the last commit.
    """
    if seconds_left is None:
        return True
    if save_seconds is None:
        return False
    return save_seconds + margin < seconds_left


def note_far_notice(logger: logging.Logger, notice: Any, seen: set[str], left: float,
                    needed: float) -> None:
    """Say once per notice (ids in ``seen``) that its deadline is far and training goes on, even
    when a nearer notice came and was cancelled meanwhile (``Run`` and the HF callback)."""
    if notice is not None and notice.id not in seen:
        seen.add(notice.id)
        logger.warning("notice %s: deadline in %.0f s; training goes on and stops about %.0f s before "
                       "it", notice.id, left, needed)


def secs(value: float | None) -> str:
    """``1.23 s``, or ``unknown`` (no estimate, no deadline)."""
    return "unknown" if value is None else f"{value:.2f} s"


def save_outcome(already: bool, saved: bool, fits: bool) -> str:
    """The stop's ``save`` for the notice timeline: ``already``, ``committed``, ``failed``, ``no_room``."""
    return "already" if already else "committed" if saved else "failed" if fits else "no_room"


def report_stop(guard: Any, record: Any, stop: dict[str, Any], saved: bool) -> bool:
    """Tell the daemon the process is safe and record the ``stop`` event (``stop``:
    :class:`~spotguard.protocol.SafeRequest`'s fields); whether the daemon took the report."""
    safe = guard.report_safe(**stop)
    notice = guard.notice
    record.emit("stop", step=stop["step"], saved=saved, seconds_left=stop["seconds_left"],
                notice=None if notice is None else {"id": notice.id, "kind": notice.kind.value},
                **stop_times(stop, guard.flagged_at(notice.id) if notice else None, safe))
    return safe


class Stopping:
    """:class:`spotguard.run.Run`'s stop on a notice (a mixin: it uses the Run's guard, agreement,
    cadence, checkpointer and record)."""

    def _local_decision(self, done: int) -> Decision:
        stop = self.guard.stop_requested
        left = self.guard.seconds_left() if stop else None
        save = self.expected_save_seconds() if stop else None
        if stop and left is not None and left > self._stop_needed(save):
            self._note_far_notice(left, save)
            stop = False
        return Decision(
            stop=stop,
            checkpoint=self._due_latched or self.guard.checkpoint_requested,
            seconds_left=left if stop else None,
            save_seconds=save if stop else None,
            durable_seconds=getattr(self.guard, "durable_s", None),
        )

    def _stop_needed(self, save_seconds: float | None) -> float:
        """Seconds before a deadline at which the loop must stop: the expected save, the margin,
        the steps until the next boundary that can act on it, and ``stop_lead``."""
        steps = self.agreement.interval if self.agreement.enabled else 1
        step_s = (getattr(self.cadence, "step_s", None) or 0.0) * steps
        return (save_seconds or 0.0) + self.save_margin + step_s + self.stop_lead

    def _note_far_notice(self, left: float, save: float | None) -> None:
        note_far_notice(log, self.guard.notice, self._far_notices, left, self._stop_needed(save))

    def _stop(self, done: int, decision: Decision, state: Any = None) -> bool:
        """Stop at ``done`` (``state``: what to save instead of the live state, see :meth:`_save`).
        torch's SIGCHLD handler, which raises a loader worker's death wherever the process is (the
        stop's signal may have reached the workers), waits meanwhile: for good when the stop ends
        the process."""
        with worker_errors_deferred(for_good=self.exit_on_stop):
            return self._stop_now(done, decision, state)

    def _stop_now(self, done: int, decision: Decision, state: Any) -> bool:
        if self._progress is not None:
            self._progress.disarm()  # the notice's forced-exit watchdog bounds the stop
        self.guard.begin_stop()
        stopped_at, left = utcnow(), decision.seconds_left
        saved, already = False, self._saved_step == done
        fits = already or save_fits(decision.save_seconds, left, self.save_margin)
        say = log.info if _exit.interrupted() else log.warning  # Ctrl-C: one line at the exit instead
        if already:
            say("stopping at step %d, already saved", done)
        elif fits:
            say("stopping at step %d: emergency save (about %.2f s, %s s left)", done,
                decision.save_seconds or 0.0, "no deadline" if left is None else f"{left:.1f}")
            saved = self._save_emergency(done, state)
        else:
            say("stopping at step %d: no time for a save (%s needed with save_margin=%.1f s, %s left); the "
                "last committed checkpoint stands", done, secs(decision.save_seconds), self.save_margin,
                secs(left))
        try:
            self.checkpointer.wait(None if left is None else max(0.0, left - self.save_margin))
        except CheckpointError as exc:  # the previous commit is still valid: stop anyway
            log.error("the last save failed (%s); the previous checkpoint stands", exc)
        stop = {"step": done, "stopped_at": stopped_at, "estimate_s": decision.save_seconds,
                "seconds_left": left, "committed_at": utcnow() if saved else None,
                "save": save_outcome(already, saved, fits)}
        self._report_stop(done, stop, saved)
        return self._exit_stopped()

    def _report_stop(self, done: int, stop: dict[str, Any], saved: bool) -> None:
        """Tell the daemon the process is safe and record the stop (``stop``: :class:`SafeRequest`'s
        fields); any thread, once."""
        report_stop(self.guard, self.record, dict(stop, step=done), saved)
        self.stopped = True
        if _exit.interrupted() and rank() == 0:
            outcome = {"committed": "saved", "already": "already saved"}.get(stop.get("save"), "not saved "
                                                                      "(the last committed checkpoint stands)")
            console.warning("spotguard: interrupted (Ctrl-C): stopped at step %d, %s; the identical command "
                            "resumes (exit 130; Ctrl-C twice aborts at once)", done, outcome)

    def _stop_between(self, outcome: dict[str, Any]) -> bool:
        """The loop came back after a stop whose save ran beside the work: end it as :meth:`_stop`."""
        if not self.stopped:
            self._report_stop(outcome["step"], outcome, outcome["save"] == "committed")
        if self._progress is not None:
            self._progress.disarm()
        return self._exit_stopped()

    def _exit_stopped(self) -> bool:
        self.close(exiting=True)
        if self.exit_on_stop:
            raise _exit.stop_exit(EXIT_PREEMPTED)
        return True

    def _stop_on_lost_loader(self, exc: BaseException) -> None:
        """``with run:`` left by an error of torch's loader (its workers died: the signal that stops
        the process reached them) while a stop is pending: save the last finished step and exit 75,
        not a traceback. One process: the state captured at the end of the last optimizer step (its
        RNG and loader position; the model and optimizer are that step's until the next one
        begins), or, before the first optimizer step of this launch, nothing new (the last commit
        stands). Returns (the error goes on) in any other case: no stop pending, not a loader's
        error, no ``optimizer=`` to tell where the loop is, or several ranks, whose other ranks are
        inside the step's collectives and cannot reach the boundary with this one
        (``spotguard.DataLoader`` fetches the batch again instead, so every rank stops together).
        torch's SIGCHLD handler, which raises the next worker's death wherever the process is, waits
        from the start (for good when the stop ends the process)."""
        with worker_errors_deferred(for_good=lambda: self.stopped and self.exit_on_stop):
            self._stop_after_loader_error(exc)

    def _stop_after_loader_error(self, exc: BaseException) -> None:
        if self.stopped or self._closed or not _from_loader(exc) or not self.guard.stop_requested:
            return
        if self._between.wait() is not None:  # its save beside the work already ran: take that stop
            self._stop_between(self._between.wait())
        if self.agreement.enabled or not self._between.enabled:
            log.error("the loader failed while stopping (%s: %s) and the last step cannot be saved here "
                      "(%s); the last commit (step %s) stands. spotguard.DataLoader starts dead workers "
                      "again at the same position instead; a loader started with spawn or forkserver keeps "
                      "its workers through the signal when passed to spotguard.ignore_stop_signals()",
                      type(exc).__name__, exc, "several ranks" if self.agreement.enabled else "no optimizer= "
                      "given to Run", self._saved_step)
            return
        log.warning("the loader failed while stopping (%s: %s): stopping at the last finished step",
                    type(exc).__name__, exc)
        finished = self._between.finished_step()
        if finished is None:
            self._between._stop_at_start()  # nothing trained since the last commit: exit 75
        done, state = finished
        decision = Decision(stop=True, seconds_left=self.guard.seconds_left(),
                            save_seconds=self.expected_save_seconds())
        self.step, self._open_step = done, None
        self._stop(done, decision, state=state)

    def _save_emergency(self, done: int, state: Any = None) -> bool:
        """Commit the state now, the loop stopped; False (logged) when the save failed."""
        try:
            self._save(done, "emergency", state=state)
        except CheckpointError as exc:  # the previous commit is still valid: stop anyway
            log.error("the emergency save failed (%s); the previous checkpoint stands", exc)
            return False
        return True
