"""A notice that lands outside a training step: during the start, an evaluation, logging or a data wait.

:class:`~spotguard.run.Run` acts on a notice at step boundaries. Much of a job's time is not spent
reaching one: the restore at start, the first step (compilation, warm-up), an evaluation loop inside
the loop body, a data stall. :class:`Between` covers that time from a thread of its own
(``spotguard-between-steps``), for a single-process run given ``optimizer=`` (its step hooks tell
where the loop is):

* **start** (from ``Run(...)`` until the first optimizer step begins: restoring, loading, the first
  step's forward and backward): nothing was trained since the last commit, so nothing is lost by
  stopping. A stopping notice ends the process at once with 75 (the stop recorded and reported safe
  first), without finishing the restore or the step.
* **clean** (from the end of one optimizer step to the start of the next: the rest of the loop
  body, the boundary, the next step's data wait and forward): the model and optimizer are those of
  the step just done. At the end of each optimizer step the RNG states and the ``loader=``
  position are captured, and every boundary puts the captured RNG states back before it saves or
  continues, so what runs between two steps (an evaluation's dropout, ``torch.rand``, a new
  ``DataLoader``'s seed) never changes training: an uninterrupted run and one stopped during its
  evaluation train on the same numbers. When a stop is decided (the far-deadline rule included)
  and the loop has not come back for :func:`act_after` (at least a step's time), the emergency save
  of that step's state (captured RNG and position, live model and optimizer, which nothing between
  steps changes) runs in this thread, beside the work. The work is then stopped at the next
  :meth:`Run.heartbeat`, the next optimizer step (which waits for the save) or the next
  boundary; with ``Run(abandon_between_steps=True)`` the process exits 75 right after the commit
  instead. Work that reaches none of these before the notice's deadline is ended with 75 (the
  state is committed) just before the guard's forced exit would end it with 76.
* **dirty** (inside an optimizer step's update): nothing is done here; the boundary acts as before.

Runs of several ranks get no thread (every rank must save the same step, and no exchange beside the
boundary's can tell each rank in time that all are still between the same two steps;
ARCHITECTURE.md says why): they act at the next boundary, or, with
``Run(agree_at_heartbeat=True)``, at the next ``run.heartbeat()`` every rank makes
(:mod:`spotguard._heartbeat`; the step hooks capture and the boundaries restore as here). Not
covered: state that changes between steps (BatchNorm statistics updated by a forward in train mode
during an evaluation; an entry of ``state=`` that the evaluation writes) is saved as it is then.

The GIL: the save's writes, fsyncs and hashing release it; its thread holds it only to encode the
state's tree, so the evaluation slows little. The thread starts with the Run (never while the loop
forks): a DataLoader forking its workers during the save is the usual case of other threads at a
fork (:mod:`spotguard._fork`; ``spotguard.DataLoader`` starts its workers with forkserver).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, NoReturn

from spotguard import _exit, rng
from spotguard._optim import hookable
from spotguard._run_stop import save_fits, secs
from spotguard._watchdog import Watchdog, run_exit_hooks
from spotguard.checkpoint.errors import CheckpointError
from spotguard.exit_codes import EXIT_INTERRUPTED, EXIT_PREEMPTED
from spotguard.protocol import utcnow

__all__ = ["Between", "Frozen", "act_after", "as_captured", "exit_now"]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
"""How often the thread looks at the guard's flags while the loop may be between steps."""
MIN_WAIT = 0.25
"""The least time the loop is given to come back to a boundary before the save runs beside it."""
EXIT_GRACE = 5.0
"""Seconds the flushes before a prompt exit may take before the process exits anyway."""


def act_after(step_seconds: float | None) -> float:
    """Seconds the loop may stay away from a boundary, after a decided stop, before the save runs
    beside it: a step's time (the boundary is then not coming soon), at least :data:`MIN_WAIT`."""
    return max(MIN_WAIT, step_seconds or 0.0)


def exit_now(code: int, reason: str) -> NoReturn:
    """End the process with ``code`` from any thread: say why, flush the logs and streams (bounded
    by a watchdog), run the forced-exit hooks (a loader's workers) and ``os._exit``."""
    if code == EXIT_PREEMPTED and _exit.interrupted():  # Ctrl-C: 130, its one line said at the stop
        code, say = EXIT_INTERRUPTED, log.info
    else:
        say = log.warning
    Watchdog(code, f"{reason}; flushing took over {EXIT_GRACE:.0f} s").arm(time.monotonic() + EXIT_GRACE)
    try:
        say("%s: exit %d now", reason, code)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except Exception:  # noqa: BLE001 - nothing may keep the exit from happening
        pass
    run_exit_hooks()
    os._exit(code)


class Frozen:
    """A state entry saved as it was captured (the RNG states, a loader's position)."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state

    def load_state_dict(self, state: Any) -> None:  # never loaded: only ever saved
        raise TypeError("a frozen entry is only saved")


def as_captured(state: dict[str, Any], rng_state: dict[str, Any], position: Any) -> dict[str, Any]:
    """``state`` to save as captured at a step's end: its RNG states and loader position frozen."""
    saved = dict(state, rng=Frozen(rng_state))
    if position is not None:
        saved["loader"] = Frozen(position)
    return saved


class Between:
    """Acts on a notice between two steps of a :class:`~spotguard.run.Run`; see the module docstring."""

    def __init__(self, run: Any, optimizer: Any, abandon: bool, ranks_agree: bool = False) -> None:
        """``ranks_agree``: a run of several ranks that agrees at ``run.heartbeat()``
        (:mod:`spotguard._heartbeat`): the step hooks capture and the boundaries restore as in one
        process, but no thread acts; the heartbeats do."""
        self.run, self.abandon = run, abandon
        inner = hookable(optimizer) if optimizer is not None else None
        self.enabled = inner is not None and (ranks_agree or not run.agreement.enabled)
        self._lock = threading.Lock()
        self._phase = "start"  # start | clean | dirty | boundary | closed
        self._since = time.monotonic()  # when the loop last passed a step's end or a boundary
        self._captured: tuple[int, dict[str, Any], Any] | None = None  # (done, RNG, loader state)
        self._acting = False
        self._total: int | None = None
        self._outcome: dict[str, Any] | None = None
        self._saved = threading.Event()
        self._closed = threading.Event()
        if not self.enabled:
            return
        self._hooks = [inner.register_step_pre_hook(self._step_begins),
                       inner.register_step_post_hook(self._step_ended)]
        if not run.agreement.enabled:
            threading.Thread(target=self._watch, name="spotguard-between-steps", daemon=True).start()

    # ------------------------------------------------------------------ the loop's side

    def enter_boundary(self) -> dict[str, Any] | None:
        """The loop reached a boundary: the stop of a save beside the work (waited for), else None
        after putting back the RNG states captured at the end of the step."""
        if not self.enabled:
            return None
        with self._lock:
            acting = self._acting
            if not acting:
                if self._phase == "clean" and self._captured is not None:
                    rng.restore(self._captured[1])
                self._phase = "boundary" if self._phase != "start" else "start"
        return self.wait() if acting else None

    def leave_boundary(self) -> None:
        """The loop goes on after a boundary: the state is still the step's (clean)."""
        if self.enabled:
            with self._lock:
                if self._phase == "boundary":
                    self._phase = "clean"
                self._since = time.monotonic()

    def clean(self) -> tuple[int, dict[str, Any], Any] | None:
        """(step done, RNG states, loader position) captured at the end of the last optimizer step,
        while the state is still that step's (between two steps), else None."""
        with self._lock:
            return self._captured if self.enabled and self._phase == "clean" else None

    def finished_step(self) -> tuple[int, dict[str, Any]] | None:
        """(step done, the state to save for it) while between two steps (:meth:`clean`), else None."""
        clean = self.clean()
        if clean is None:
            return None
        done, rng_state, position = clean
        return done, as_captured(self.run.state, rng_state, position)

    def wait(self) -> dict[str, Any] | None:
        """The outcome of the stop that began beside the work (after its save), else None."""
        if not self._acting:
            return None
        self._saved.wait()
        return self._outcome

    def close(self) -> None:
        if self.enabled and not self._closed.is_set():
            self._closed.set()
            for hook in self._hooks:
                hook.remove()

    def _step_begins(self, *_: Any) -> None:
        """An optimizer step begins: wait for a save beside the work (it reads the live state),
        and stop; else the state is no longer the captured one."""
        with self._lock:
            acting = self._acting
            if not acting:
                self._phase = "dirty"
        if acting:
            self.run._stop_between(self.wait())

    def _step_ended(self, *_: Any) -> None:
        loader = self.run.state.get("loader")
        position = loader.state_dict() if callable(getattr(loader, "state_dict", None)) else None
        captured = (self.run.step + 1, rng.capture(), position)
        with self._lock:
            self._captured, self._phase, self._since = captured, "clean", time.monotonic()

    # ------------------------------------------------------------------ the thread's side

    def _watch(self) -> None:
        while not self._closed.wait(POLL_SECONDS):
            try:
                if self._check():
                    return
            except Exception:  # noqa: BLE001 - this thread must never die silently mid-run
                log.exception("spotguard between-steps watch failed; the boundaries still act")
                return

    def _check(self) -> bool:
        """Look once; True when a stop began here (the thread's work is then done)."""
        run = self.run
        with self._lock:
            phase, since, captured = self._phase, self._since, self._captured
        if phase not in ("start", "clean") or run.stopped or not run.guard.stop_requested:
            return False
        if phase == "clean" and time.monotonic() - since < act_after(getattr(run.cadence, "step_s", None)):
            return False
        if phase == "start" and not self._start_may_stop():
            return False
        decision = run._local_decision(run.step)  # the far-deadline rule, as at a boundary
        if not decision.stop:
            return False
        with self._lock:
            if self._phase != phase or self._captured is not captured or self._acting:
                return False  # the loop came back meanwhile: the boundary acts
            self._acting = True
        if phase == "start":
            self._stop_at_start()
        self._save_beside(captured, decision)
        return True

    def starting(self, total: int) -> None:
        """:meth:`Run.steps` began, for ``total`` steps: a stop during the start may act from now."""
        self._total = total

    def _start_may_stop(self) -> bool:
        """Whether a stop may end the start: once :meth:`Run.steps` runs, unless the newest local
        checkpoint already holds the last step (a finished job relaunched under a pending notice
        exits 0 at its first boundary)."""
        if self._total is None:
            return False
        latest = self.run.checkpointer.latest()
        return latest is None or latest.step < self._total

    def _stop_at_start(self) -> NoReturn:
        run = self.run
        run.guard.begin_stop()
        done = run._saved_step if run._saved_step is not None else run.step
        (log.info if _exit.interrupted() else log.warning)(
            "stop during the start (restore, load or first step): nothing was trained since the last "
            "commit (step %d)", done)
        run._report_stop(done, {"step": done, "stopped_at": utcnow(), "estimate_s": None,
                                "seconds_left": run.guard.seconds_left(), "committed_at": None,
                                "save": "already"}, saved=False)
        exit_now(EXIT_PREEMPTED, "stopped before the first step")

    def _save_beside(self, captured: tuple[int, dict[str, Any], Any], decision: Any) -> None:
        try:
            self._outcome = self._commit_beside(captured, decision)
            if self.abandon:
                outcome = self._outcome
                self.run._report_stop(outcome["step"], outcome, saved=outcome["save"] == "committed")
                exit_now(EXIT_PREEMPTED, f"step {outcome['step']} {outcome['save']}; the work between steps "
                         "is abandoned (Run(abandon_between_steps=True))")
            self._bound_overrun()
        finally:
            self._saved.set()

    def _commit_beside(self, captured: tuple[int, dict[str, Any], Any], decision: Any) -> dict[str, Any]:
        run, (done, rng_state, position) = self.run, captured
        run.guard.begin_stop()
        stopped_at, left = utcnow(), decision.seconds_left
        already = run._saved_step == done
        fits = already or save_fits(decision.save_seconds, left, run.save_margin)
        saved = False
        say = log.info if _exit.interrupted() else log.warning  # Ctrl-C: one line at the stop instead
        if already:
            say("stopping between steps, step %d already saved", done)
        elif fits:
            say("stopping between steps: emergency save of step %d beside the work (about %.2f s, %s)", done,
                decision.save_seconds or 0.0, "no deadline" if left is None else f"{left:.1f} s left")
            try:
                run._save(done, "emergency", state=as_captured(run.state, rng_state, position))
                saved = True
            except CheckpointError as exc:
                log.error("the emergency save failed (%s); the previous checkpoint stands", exc)
        else:
            say("stopping between steps: no time for a save (%s needed with save_margin=%.1f s, %s left); "
                "the last committed checkpoint stands", secs(decision.save_seconds), run.save_margin,
                secs(left))
        try:
            run.checkpointer.wait(None if left is None else max(0.0, left - run.save_margin))
        except CheckpointError as exc:
            log.error("the last save failed (%s); the previous checkpoint stands", exc)
        return {"step": done, "stopped_at": stopped_at, "estimate_s": decision.save_seconds,
                "seconds_left": left, "committed_at": utcnow() if saved else None,
                "save": "already" if already else "committed" if saved else "failed" if fits else "no_room"}

    def _bound_overrun(self) -> None:
        """Work that reaches no heartbeat, optimizer step or boundary before the deadline ends with 75
        (the stop is over: saved, or no room), just before the guard's forced exit would say 76."""
        at, outcome = self.run.guard.forced_exit_at, self._outcome
        if at is None:
            return
        reason = (f"the work between steps reached no run.heartbeat(), optimizer step or boundary before "
                  f"the deadline; the stop at step {outcome['step']} is over ({outcome['save']})")

        def report() -> None:
            if not self.run.stopped:  # the loop never took the stop: report it from here
                self.run._report_stop(outcome["step"], outcome, saved=outcome["save"] == "committed")

        Watchdog(EXIT_PREEMPTED, reason, before_exit=report).arm(max(time.monotonic(), at - 0.5))
