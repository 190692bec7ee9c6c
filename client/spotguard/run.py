"""The easy path: a plain PyTorch loop that checkpoints, resumes and stops cleanly in a few lines.

::

    run = spotguard.Run("checkpoints", model=model, optimizer=opt, scheduler=sched)
    for step in run.steps(total_steps):     # loads the latest checkpoint, resumes after its step
        loss = train_step(step)
    run.finish()                            # or: with spotguard.Run(...) as run: ...

:class:`Run` composes the :class:`~spotguard.checkpoint.Checkpointer`, a :class:`~spotguard.guard.Guard`,
a :class:`~spotguard.cadence.Cadence` (or a fixed ``save_every``), the RNG state and the
:class:`~spotguard.distributed.Agreement`. Step numbers count completed steps: the checkpoint taken
after step ``s`` ran is saved as step ``s + 1``, and a resumed run's first step is that number, so
the identical command starts fresh or resumes.

At each step boundary (after the loop body, before the next step):

1. the local flags (stop requested, checkpoint due or requested) are agreed across ranks;
2. a due checkpoint is saved asynchronously (training continues while it persists);
3. a stopping notice whose deadline is further away than the expected save, ``save_margin``,
   the steps until the next boundary and ``stop_lead`` lets training go on (a scheduled retirement
   announced minutes or days ahead); the loop stops at the last boundary that leaves that much time.
   A notice without a deadline (a bare signal) stops at the next boundary;
4. on a stop: an emergency save is taken only when its expected duration plus ``save_margin``
   fits before the deadline (:func:`save_fits`), else the last committed checkpoint stands. The
   expected duration is the state's bytes at the emergency path's measured bandwidth
   (:meth:`Checkpointer.emergency_seconds`); the save itself is ``save(blocking=True)``, written
   from live memory at the disk's speed (:mod:`spotguard.checkpoint.emergency`). The
   pending save is awaited, the daemon is told the process is safe, and the loop raises
   ``SystemExit(EXIT_PREEMPTED)`` (75) so the caller's ``finally`` blocks and context managers
   run; when it ends the program, the interpreter's own teardown (seconds of CPU with torch
   loaded, past a short platform grace) is skipped by an ``os._exit(75)`` once the ``atexit``
   handlers ran (:mod:`spotguard._exit`: what runs, what is skipped, ``$SPOTGUARD_FAST_EXIT=0``).
   ``exit_on_stop=False`` ends the iteration instead and sets :attr:`Run.stopped`. Either
   way the process is expected to exit: the forced-exit watchdog stays armed and SIGTERM/SIGUSR1
   stay ignored (:meth:`Guard.close` with ``exiting=True``).

**A peer that vanished** (its node killed outright, no notice) must not leave the survivors hanging
in a collective until torch's 30-minute default. (A collective of the loop itself that fails at once,
gloo's "Connection closed by peer" in DDP's backward, ends the process the same way when it leaves
``with run:``.) With more than one rank, ``peer_timeout`` (600 s by
default; None turns this off) bounds it twice: the agreement's own collective gives up after that
long (:class:`~spotguard.distributed.PeerLostError`, logged with its cause), and a progress
watchdog ends the process when no step boundary is reached for ``peer_timeout`` plus
:data:`PEER_LOST_GRACE` (a collective of the step itself, e.g. DDP's all-reduce, waiting for the
lost peer; every thread's stack is dumped). Either way the process ends at once with
``EXIT_PEER_LOST`` (77), through ``os._exit``: a process group whose peer is gone cannot be torn
down (interpreter exit waits for the save in flight, itself waiting for the peer, or aborts in
gloo's destructors), and ``finally`` blocks would only run into the same collectives. The last
committed checkpoint stands. Work that really takes longer than ``peer_timeout`` between two
steps (an evaluation inside the loop) calls :meth:`Run.heartbeat` now and then, or needs a larger
value.

Leaving the loop early with ``break`` (or ``return``) is safe: :meth:`finish` saves the state as
it is, counting the step left mid-way as done when the optimizer given to ``Run`` stepped in it
(an optimizer step hook tells), and as not done otherwise, in which case a ``spotguard.DataLoader``
given as ``loader=`` is put back to where that step began, so its batches are trained on resume.
The identical command then resumes after the last step that updated the model. Without an
``optimizer=`` spotguard cannot tell and warns; leave the loop at a step's start then.

Without ``job_id`` (or ``$SPOTGUARD_JOB_ID``) the run's id is derived from its command line and working directory
(:mod:`spotguard._jobid`, logged at start), so two experiments never share checkpoints in the
durable store; a checkpoint that does not fit the state is refused with a message naming the fix.

Every commit is reported to the daemon (``CommitRequest``), and rank 0's progress every few seconds
(``ProgressRequest``, sent by the guard's thread; see :class:`~spotguard.guard.Guard`), so the daemon
can count the steps a restart loses after the last commit. Nothing needs a daemon. With
``$SPOTGUARD_RECORD`` set, the run's start, progress, commits, stop and final state digest are
appended to that file (:mod:`spotguard._record`) for ``spotguard drill`` and ``spotguard run``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import datetime
from typing import Any, Callable, Iterator, Mapping, NoReturn

from spotguard import _ddp, _exit, _jobid, rng
from spotguard._optim import hookable
from spotguard._peer import exit_peer_lost, is_peer_failure
from spotguard._audit import Audit
from spotguard._between import Between
from spotguard._record import Recorder, stop_times
from spotguard._stall import LocalHangs
from spotguard._watchdog import Watchdog
from spotguard.cadence import job_nodes
from spotguard.checkpoint import Checkpointer, CheckpointCorruptError, CheckpointError
from spotguard.checkpoint.emergency import ASSUMED_THROUGHPUT  # noqa: F401 (integrations import it here)
from spotguard.checkpoint.load import read_manifest
from spotguard.distributed import Agreement, Decision, PeerLostError
from spotguard.exit_codes import EXIT_PEER_LOST, EXIT_PREEMPTED
from spotguard.guard import DEFAULT_SIGNAL_DEADLINES, Guard
from spotguard.protocol import utcnow
from spotguard.storage import StoreError, restore_newer, store_from_env
from spotguard.storage.fresh_node import RestoreFailed

__all__ = ["Run", "save_fits"]

log = logging.getLogger(__name__)

PEER_LOST_GRACE = 10.0
"""Seconds the progress watchdog allows beyond ``peer_timeout``, so that when the loop waits in the
agreement, the agreement's own timeout (which logs and records the cause) comes first."""


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


class _RngState:
    """Adapts :mod:`spotguard.rng` to the state_dict protocol the checkpointer saves."""

    def state_dict(self) -> dict[str, Any]:
        return rng.capture()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng.restore(state)


class Run:
    """A resumable training run over ``root``; see the module docstring for the contract."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        sampler: Any = None,
        loader: Any = None,
        state: Mapping[str, Any] | None = None,
        job_id: str = "",
        keep: int = 3,
        save_every: int | None = None,
        cadence: Any = None,
        save_margin: float = 2.0,
        stop_lead: float = 60.0,
        exit_on_stop: bool = True,
        daemon: bool = True,
        signal_deadlines: Mapping[int, float | None] = DEFAULT_SIGNAL_DEADLINES,
        process_group: Any = None,
        on_commit: Callable[[Any], None] | None = None,
        guard: Guard | None = None,
        durable: str | None = None,
        peer_timeout: float | None = 600.0,
        abandon_between_steps: bool = False,
    ) -> None:
        self.state = _build_state(model, optimizer, scheduler, sampler, state)
        self.state.update(_ddp.entries(self.state))  # DDP's real bucket layout, for an exact resume
        if stop_lead < 0:
            raise ValueError("stop_lead must be >= 0")
        if loader is not None:
            self.state.setdefault("loader", _loader_entry(loader))
        self.save_margin, self.stop_lead, self.exit_on_stop = save_margin, stop_lead, exit_on_stop
        self._far_notice: str | None = None
        process_group = _default_group(process_group)
        self.agreement = Agreement(process_group, timeout=peer_timeout)
        self.peer_timeout = peer_timeout
        stalled = (f"no step boundary for {(peer_timeout or 0) + PEER_LOST_GRACE:.0f} s (Run(peer_timeout="
                   f"{peer_timeout})), and this rank was waiting neither for its loader nor for its own save: "
                   "a peer rank is probably gone")
        self._progress = (Watchdog(EXIT_PEER_LOST, stalled, before_exit=self._record_forced_exit,
                                   probe=LocalHangs(self, peer_timeout, _rank()).probe)
                          if peer_timeout and self.agreement.enabled else None)
        self.cadence = _make_cadence(save_every, cadence)
        self._user_on_commit = on_commit
        job_id = job_id or os.environ.get(_jobid.ENV, "")
        derived = not job_id
        self.job_id = job_id = _jobid.agree(job_id or _jobid.derive(), given=not derived,
                                            process_group=process_group)  # rank 0's, on every node
        log.info("job id %s%s", job_id, " (derived from the command line and working directory; pass "
                 "job_id= to choose one)" if derived else "")
        self.checkpointer = Checkpointer(root, keep=keep, job_id=job_id, process_group=process_group,
                                         on_commit=self._on_commit)
        self.guard = guard or Guard(job_id=job_id, rank=_rank(), daemon=daemon,
                                    signal_deadlines=signal_deadlines, nodes=job_nodes())
        self._job_id, self._durable = job_id, durable
        self.record = Recorder(rank=_rank(), job=job_id)
        self._audit = Audit(self.record, self.state)  # samples per step, state left out
        self._save_kinds: dict[int, str] = {}
        self._save_reached: dict[int, datetime] = {}
        """Step saved -> when the loop reached it, for the daemon's goodput (the commit comes later)."""
        self._fixed_cadence = save_every is not None
        self._due_latched = False
        self.step = self.start_step = 0
        self.stopped = False
        self.resumed_from: Any = None
        self._saved_step: int | None = None
        self._last_boundary: float | None = None
        self._pending_observation = False
        self._closed = False
        self._open_step: tuple[int, Any] | None = None  # (optimizer steps, loader state) at a yield
        self._optimizer_steps = 0
        self._counts_steps = _count_steps(optimizer, self._count_optimizer_step)
        self._between = Between(self, optimizer, abandon_between_steps)  # a notice outside a step

    # ------------------------------------------------------------------ the loop

    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers still to run, resuming after the latest committed checkpoint."""
        self._between.starting(total)
        self._restore_from_store()
        try:
            self.resumed_from = self._load_latest()
        except Exception as exc:
            self.record.emit("load_failed", error=f"{type(exc).__name__}: {exc}")
            raise
        self.step = self._saved_step = self.resumed_from.step if self.resumed_from else 0
        self.start_step = self.step
        if self.resumed_from is not None:
            log.info("resumed from step %d (%s)", self.step, self.resumed_from.path)
            _ddp.restore(self.state)  # DDP's recorded buckets: the next steps all-reduce as if never stopped
            self.guard.report_resume(self.step)
        self.record.start(root=self.checkpointer.root, world_size=self.checkpointer.world_size,
                          resumed_from=self.start_step if self.resumed_from else None,
                          skipped=self.checkpointer.skipped, total=total, entries=sorted(self.state),
                          loaded_digest=getattr(self.resumed_from, "digest", None))
        if self.step >= total:
            log.info("already finished: step %d of %d is committed; nothing to run", self.step, total)
            return  # a completed job relaunched under a pending notice must exit 0, not 75
        try:
            if self._at_boundary(self.step):
                return
            while self.step < total:
                self._open_step = (self._optimizer_steps, self._loader_mark())
                yield self.step
                self._open_step = None
                self.step += 1
                if self._at_boundary(self.step):
                    return
        finally:  # the loop ended, or was left (break closes this generator)
            if self._progress is not None:
                self._progress.disarm()

    def _load_latest(self) -> Any:
        """Load the newest checkpoint; one that does not fit the state (another model, another run
        in this root) is refused with a message naming the fix, never half-loaded silently."""
        try:
            info = self.checkpointer.load_latest(self.state)
        except CheckpointCorruptError:
            raise
        except CheckpointError as exc:
            latest = self.checkpointer.latest()
            if latest is None:
                raise
            raise CheckpointError(_jobid.mismatch_message(
                latest.path, read_manifest(latest.path), self._job_id, " ".join(str(exc).split()).rstrip("."))) from exc
        if info is not None:
            manifest = read_manifest(info.path)
            _jobid.check_matches(manifest, self.state, self._job_id, info.path)
            if manifest.get("job_id") not in ("", None, self._job_id):
                log.warning("resuming %s, written by job %r; this is job %r (same checkpoint root)",
                            info.path, manifest.get("job_id"), self._job_id)
        return info

    def _restore_from_store(self) -> None:
        """The fresh-node case: when the durable store holds a newer checkpoint than the local root,
        fetch it first, so the load below finds it. The store is ``durable=``, else
        ``$SPOTGUARD_STORAGE__URL``, else the daemon's; one process per node fetches while the others
        wait. A store that keeps failing (transient errors are retried for a minute) is logged and
        training goes on from what is local; when the store held, or may have held, a newer
        checkpoint, that is an error and a ``restore_failed`` record event (work is lost)."""
        url, options = store_from_env()
        url = self._durable or url or self._daemon_store()
        if url and _local_rank() == 0:
            try:
                restore_newer(self.checkpointer.root, self._job_id, url, options)
            except RestoreFailed as exc:
                log.error("%s; going on with local checkpoints (steps after them are trained again)", exc)
                self.record.emit("restore_failed", store=url.split("?", 1)[0], store_step=exc.store_step,
                                 local_step=exc.local_step, error=str(exc))
            except (StoreError, OSError) as exc:
                log.warning("could not restore from %s (%s); going on with local checkpoints", url, exc)
        if self.agreement.enabled:
            _distributed().barrier(group=self.agreement.process_group)

    def _daemon_store(self) -> str | None:
        uploads = (self.guard.daemon_status() or {}).get("uploads") or {}
        store = uploads.get("store")
        return store if isinstance(store, str) and "://" in store else None

    def finish(self, *, at_boundary: bool = False) -> None:
        """Save the final state (if not saved yet), wait until it is committed, and close.

        ``at_boundary``: the loop ended between two steps, not inside the step last yielded (a
        framework's loop driving :meth:`steps` from its step-end hook ended on its own)."""
        if self._closed:
            return
        if self._between.wait() is not None:  # a stop began beside the work: take it
            self._stop_between(self._between.wait())
            return
        if at_boundary:
            self._open_step = None
        if not self.stopped:
            self._close_open_step()
        if not self.stopped and self._saved_step != self.step:
            self._save(self.step, "final")
        last = self.checkpointer.wait(None)
        self.close()
        if not self.stopped and last is not None and last.step == self.step:
            self.record.emit("finish", step=self.step, digest=last.digest)

    def heartbeat(self) -> bool:
        """Call it now and then from work between two steps, such as an evaluation loop.

        When a notice's save ran beside that work (:mod:`spotguard._between`), this is where the
        work stops: it waits for the save, then raises ``SystemExit(75)`` as a boundary would
        (``exit_on_stop=False``: returns True, and the loop ends at its next boundary). Otherwise
        it returns False, after telling the peer-loss progress watchdog this rank is busy, not stuck."""
        outcome = self._between.wait()
        if outcome is not None:
            return self._stop_between(outcome)
        if self._progress is not None and self._progress.armed_at is not None:
            self._progress.reset(time.monotonic() + self.peer_timeout + PEER_LOST_GRACE)
        return False

    def _record_forced_exit(self) -> None:
        """The progress watchdog's exit, in the run record (its thread, one write): a lost peer, or
        a hang of this rank's own (:mod:`spotguard._stall`)."""
        code, reason = self._progress.fired
        if code == EXIT_PEER_LOST:
            self.record.emit("peer_lost", step=self.step, error=reason)
        else:
            self.record.emit("forced_exit", reason=reason)

    def _count_optimizer_step(self, *_: Any) -> None:
        self._optimizer_steps += 1

    def _loader_mark(self) -> Any:
        loader = self.state.get("loader")
        return loader.state_dict() if _is_spotguard_loader(loader) else None

    def _close_open_step(self) -> None:
        """The loop was left inside a step: count it when the optimizer stepped in it, else undo
        the data it drew, so the final checkpoint names the state the model is really in."""
        if self._open_step is None:
            return
        optimizer_steps, mark = self._open_step
        self._open_step = None
        if not self._counts_steps:
            log.warning("the loop was left inside step %d and Run has no optimizer to tell whether it "
                        "updated the model: saving it as not done", self.step)
        elif self._optimizer_steps > optimizer_steps:
            self.step += 1
        elif mark is not None:
            self.state["loader"].load_state_dict(mark)

    def close(self, *, exiting: bool = False) -> None:
        """Close the checkpointer (waiting for its save in flight) and the guard, without saving.

        ``exiting`` is :meth:`Guard.close`'s: the process is about to exit after a stop.
        """
        if self._closed:
            return
        self._closed = True
        self._between.close()
        self._audit.close()
        try:
            self.checkpointer.close()
        finally:
            self.guard.close(exiting=exiting)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        elif is_peer_failure(exc):  # the loop's own collective (DDP's backward) met a lost peer
            self._peer_lost(self.step, exc)
        else:
            self.close(exiting=isinstance(exc, SystemExit))

    # ------------------------------------------------------------------ boundaries

    def _at_boundary(self, done: int) -> bool:
        """A boundary: stop when a save ran beside the work since the last one, else act on it."""
        outcome = self._between.enter_boundary()
        if outcome is not None:
            return self._stop_between(outcome)
        ended = self._boundary(done)
        self._between.leave_boundary()
        return ended

    def _boundary(self, done: int) -> bool:
        """Act on the agreed decision after ``done`` steps; True when the loop must end."""
        if self._progress is not None:
            self._progress.reset(time.monotonic() + self.peer_timeout + PEER_LOST_GRACE)  # arms it
        self._observe()
        self.record.progress(done)
        self._audit.step(done)
        self.guard.report_progress(done)
        due = self.cadence.due(done)  # asked at every boundary so its count moves alike everywhere
        if due and self._fixed_cadence:
            self._save(done)  # a fixed step count is due at the same step on every rank
        else:
            self._due_latched |= due and _rank() == 0  # rank 0's cadence (the daemon's MTBF) decides
        if self.agreement.enabled and not self.agreement.due(done):
            return False  # flags wait for the next exchange: every rank acts at the same step
        try:
            decision = self.agreement.agree(done, self._local_decision(done))
        except PeerLostError as exc:
            self._peer_lost(done, exc)
        self._due_latched = False
        if decision.stop:
            return self._stop(done, decision)
        if decision.checkpoint and self._saved_step != done:
            self._save(done, "requested")
            self.guard.clear_checkpoint_request()
        return False

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
        )

    def _stop_needed(self, save_seconds: float | None) -> float:
        """Seconds before a deadline at which the loop must stop: the expected save, the margin,
        the steps until the next boundary that can act on it, and ``stop_lead``."""
        steps = self.agreement.interval if self.agreement.enabled else 1
        step_s = (getattr(self.cadence, "step_s", None) or 0.0) * steps
        return (save_seconds or 0.0) + self.save_margin + step_s + self.stop_lead

    def _note_far_notice(self, left: float, save: float | None) -> None:
        notice = self.guard.notice
        if notice is not None and notice.id != self._far_notice:
            self._far_notice = notice.id
            log.warning("notice %s: deadline in %.0f s; training goes on and stops about %.0f s before "
                        "it", notice.id, left, self._stop_needed(save))

    def _peer_lost(self, done: int, exc: PeerLostError) -> NoReturn:
        """Say why, record it, and end the process now (see the module docstring: no teardown)."""
        exit_peer_lost(exc, self.record, done)

    def _stop(self, done: int, decision: Decision) -> bool:
        if self._progress is not None:
            self._progress.disarm()  # the notice's forced-exit watchdog bounds the stop
        self.guard.begin_stop()
        stopped_at, left = utcnow(), decision.seconds_left
        saved, already = False, self._saved_step == done
        fits = already or save_fits(decision.save_seconds, left, self.save_margin)
        if already:
            log.warning("stopping at step %d, already saved", done)
        elif fits:
            log.warning("stopping at step %d: emergency save (about %.2f s, %s s left)", done,
                        decision.save_seconds or 0.0, "no deadline" if left is None else f"{left:.1f}")
            saved = self._save_emergency(done)
        else:
            log.warning("stopping at step %d: no time for a save (%s s needed, %s s left); the last "
                        "committed checkpoint stands", done, decision.save_seconds, left)
        try:
            self.checkpointer.wait(None if left is None else max(0.0, left - self.save_margin))
        except CheckpointError as exc:  # the previous commit is still valid: stop anyway
            log.error("the last save failed (%s); the previous checkpoint stands", exc)
        stop = {"step": done, "stopped_at": stopped_at, "estimate_s": decision.save_seconds,
                "seconds_left": left, "committed_at": utcnow() if saved else None,
                "save": "already" if already else "committed" if saved else "failed" if fits else "no_room"}
        self._report_stop(done, stop, saved)
        return self._exit_stopped()

    def _report_stop(self, done: int, stop: dict[str, Any], saved: bool) -> None:
        """Tell the daemon the process is safe and record the stop (``stop``: :class:`SafeRequest`'s
        fields); any thread, once."""
        safe = self.guard.report_safe(**stop)
        self.stopped = True
        notice = self.guard.notice
        self.record.emit("stop", step=done, saved=saved, seconds_left=stop["seconds_left"],
                         notice=None if notice is None else {"id": notice.id, "kind": notice.kind.value},
                         **stop_times(stop, self.guard.flagged_at(notice.id) if notice else None, safe))

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

    def _save_emergency(self, done: int) -> bool:
        """Commit the state now, the loop stopped; False (logged) when the save failed."""
        try:
            self._save(done, "emergency")
        except CheckpointError as exc:  # the previous commit is still valid: stop anyway
            log.error("the emergency save failed (%s); the previous checkpoint stands", exc)
            return False
        return True

    def _save(self, done: int, kind: str = "periodic", state: Mapping[str, Any] | None = None) -> None:
        """Save ``state`` (default: the run's) as step ``done``; an emergency save commits first."""
        self._save_kinds[done] = kind
        self._save_reached[done] = utcnow()
        _ddp.settle(self.state)  # every rank: DDP's due bucket rebuild happens before the snapshot
        self._audit.saving(done)  # the record's progress marks (RNG, LR, epoch, loss) of this save
        self.checkpointer.save(done, self.state if state is None else state, blocking=kind == "emergency")
        self._saved_step = done
        self.cadence.mark_saved(done)

    def _on_commit(self, info: Any) -> None:
        """Runs in the checkpointer's persist thread: report, and let the main thread observe."""
        self._pending_observation = True
        stats = self.checkpointer.stats
        self.record.emit("commit", step=info.step, kind=self._save_kinds.pop(info.step, "periodic"),
                         digest=info.digest, path=str(info.path), bytes=stats.bytes,
                         blocking_s=round(stats.blocking_seconds, 6), persist_s=round(stats.persist_seconds, 6))
        self.guard.report_commit(info, save_seconds=max(0.0, stats.blocking_seconds or 0.0),
                                 reached_at=self._save_reached.pop(info.step, None))
        if self._user_on_commit is not None:
            self._user_on_commit(info)

    def _observe(self) -> None:
        now = time.monotonic()
        if self._last_boundary is not None:
            self.cadence.observe_step(now - self._last_boundary)
        self._last_boundary = now
        if hasattr(self.cadence, "follow"):
            self.cadence.follow(getattr(self.guard, "job_rate", None))  # the daemon's learned MTBF
        if self._pending_observation:
            self._pending_observation = False
            stats = self.checkpointer.stats
            if (stats.blocking_seconds or 0) + (stats.persist_seconds or 0) > 0:
                self.cadence.observe_save(stats.blocking_seconds or 0.0, stats.persist_seconds or 0.0)

    def expected_save_seconds(self) -> float | None:
        """Expected notice-to-committed seconds of an emergency save now: the state's bytes (the
        last save's, else counted) at the emergency path's measured bandwidth, which periodic saves
        seed and each emergency save updates (:meth:`Checkpointer.emergency_seconds`)."""
        size = self.checkpointer.stats.bytes or _state_bytes(self.state)
        return self.checkpointer.emergency_seconds(size) if size else None


def _count_steps(optimizer: Any, hook: Callable[..., None]) -> bool:
    """Register ``hook`` to run after each real step of ``optimizer`` (unwrapped as
    :func:`spotguard._optim.hookable` says); False when it cannot tell."""
    inner = hookable(optimizer)
    if inner is None:
        return False
    inner.register_step_post_hook(hook)
    return True


def _make_cadence(save_every: int | None, cadence: Any) -> Any:
    from spotguard.cadence import Cadence

    if cadence is not None and save_every is not None:
        raise ValueError("give save_every or cadence, not both")
    return cadence or Cadence(every_steps=save_every, nodes=job_nodes())


def _build_state(model: Any, optimizer: Any, scheduler: Any, sampler: Any,
                 extra: Mapping[str, Any] | None) -> dict[str, Any]:
    named = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    state = {name: obj for name, obj in named.items() if obj is not None}
    state.update(extra or {})
    state.setdefault("rng", _RngState())
    return state


def _loader_entry(loader: Any) -> Any:
    """The checkpoint entry of ``Run(loader=...)``: a spotguard.DataLoader is one; torchdata's
    StatefulDataLoader goes through LoaderState; a plain DataLoader is refused with the fix."""
    from spotguard.data import DataLoader
    from spotguard.sampler import LoaderState

    if isinstance(loader, DataLoader):
        return loader
    if callable(getattr(loader, "state_dict", None)):
        return LoaderState(loader)
    raise TypeError(f"Run(loader=) cannot resume a {type(loader).__name__} exactly: build it with "
                    "spotguard.DataLoader (same arguments), or use torchdata's StatefulDataLoader")


def _is_spotguard_loader(obj: Any) -> bool:
    data = sys.modules.get("spotguard.data")
    return data is not None and isinstance(obj, data.DataLoader)


def _state_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of every tensor reachable from the state's state_dicts (an estimate for a first save)."""
    def walk(obj: Any) -> int:
        if hasattr(obj, "element_size") and hasattr(obj, "nelement"):
            return obj.element_size() * obj.nelement()
        if isinstance(obj, Mapping):
            return sum(walk(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(walk(v) for v in obj)
        return 0

    return sum(walk(o.state_dict() if hasattr(o, "state_dict") else o) for o in state.values())


def _distributed() -> Any:
    """``torch.distributed`` when it is initialised, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _default_group(process_group: Any) -> Any:
    """The world group when distributed runs and no group was given (the checkpointer then
    coordinates its commits across ranks), else ``process_group`` as given."""
    dist = _distributed()
    if process_group is None and dist is not None and dist.get_world_size() > 1:
        return dist.group.WORLD
    return process_group


def _local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``), 0 outside a launcher."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def _rank() -> int:
    dist = _distributed()
    return dist.get_rank() if dist is not None else 0
