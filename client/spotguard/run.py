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

**A notice between steps** (an evaluation inside the loop body) is acted on beside the work in one
process (:mod:`spotguard._between`). With several ranks it waits for the next boundary, unless every
rank calls :meth:`Run.heartbeat` at the same points of that work and says so with
``agree_at_heartbeat=True``: the ranks then agree at those calls, and save and stop there together
(:mod:`spotguard._heartbeat`).

Leaving the loop early with ``break`` (or ``return``) is safe: :meth:`finish` saves the state as
it is, counting the step left mid-way as done when the optimizer given to ``Run`` stepped in it
(an optimizer step hook tells), and as not done otherwise, in which case a ``spotguard.DataLoader``
given as ``loader=`` is put back to where that step began, so its batches are trained on resume.
The identical command then resumes after the last step that updated the model. Without an
``optimizer=`` spotguard cannot tell and warns; leave the loop at a step's start then.

Without ``job_id`` (or ``$SPOTGUARD_JOB_ID``) the run's id is derived from its command line and working directory
(:mod:`spotguard._jobid`, logged at start), so two experiments never share checkpoints in the
durable store; a checkpoint that does not fit the state is refused with a message naming the fix.

At start, the root's leader (rank 0, or each node's first rank with node-local roots) probes the
root with a write and locks it (:mod:`spotguard._root`): an unwritable root, or one another launch
holds, is refused with one line (exit 1). Rank 0 then prints one start line on stderr (job id,
resumed step and where from, or a fresh start; :mod:`spotguard._console`). ``fresh=True`` (else
``$SPOTGUARD_FRESH=1``) starts over: the root's committed checkpoints are removed and nothing is
restored (refused when the durable store holds checkpoints of the job: it needs a new id). Ctrl-C
(SIGINT) stops at the next boundary with a save and exits 130; a second one aborts at once.

Every commit is reported to the daemon (``CommitRequest``), and rank 0's progress every few seconds
(``ProgressRequest``, sent by the guard's thread; see :class:`~spotguard.guard.Guard`), so the daemon
can count the steps a restart loses after the last commit and learn how often the job is interrupted:
the reply carries that MTBF back, and rank 0's cadence plans with it. Nothing needs a daemon. With
``$SPOTGUARD_RECORD`` set, the run's start, progress, commits, stop and final state digest are
appended to that file (:mod:`spotguard._record`) for ``spotguard drill`` and ``spotguard run``.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NoReturn

from spotguard import _ddp, _jobid, _root
from spotguard._console import console, start_line
from spotguard._peer import exit_peer_lost, is_peer_failure
from spotguard._audit import Audit
from spotguard._between import Between, Frozen
from spotguard._heartbeat import Heartbeats
from spotguard._record import Recorder
from spotguard._run_parts import RngState as _RngState  # noqa: F401 (tests import it here)
from spotguard._run_parts import (build_state, count_steps, default_group, is_spotguard_loader, loader_entry,
                                  cadence_source, make_cadence, rank, state_bytes, unjoined_ranks)
from spotguard._run_common import fetched_tier
from spotguard._run_start import fresh_requested, load_latest, plan, restore_from_store, start_fresh
from spotguard._run_stop import Stopping, save_fits  # noqa: F401 (save_fits is public here)
from spotguard._stall import LocalHangs
from spotguard._watchdog import Watchdog
from spotguard.cadence import job_nodes
from spotguard.checkpoint import Checkpointer
from spotguard.checkpoint.emergency import ASSUMED_THROUGHPUT  # noqa: F401 (integrations import it here)
from spotguard.distributed import Agreement, PeerLostError
from spotguard.exit_codes import EXIT_PEER_LOST
from spotguard.guard import DEFAULT_SIGNAL_DEADLINES, Guard
from spotguard.protocol import utcnow

__all__ = ["Run", "save_fits"]

log = logging.getLogger(__name__)

PEER_LOST_GRACE = 10.0
"""Seconds the progress watchdog allows beyond ``peer_timeout``, so that when the loop waits in the
agreement, the agreement's own timeout (which logs and records the cause) comes first."""


class Run(Stopping):
    """A resumable training run over ``root``; see the module docstring for the contract.

    :param root: The checkpoint directory (created if missing; one per job).
    :param model: The model (its ``state_dict`` is saved and loaded in place); a DDP or FSDP
        wrapper may be given as is.
    :param optimizer: The optimizer; its steps also tell which step a ``break`` left mid-way.
    :param scheduler: The learning-rate scheduler.
    :param sampler: A sampler with ``state_dict``, e.g. :class:`~spotguard.sampler.ResumableSampler`.
    :param loader: A :class:`spotguard.DataLoader` (or torchdata's ``StatefulDataLoader``): its
        position is saved, so a resumed run draws the batches it would have drawn.
    :param state: Further named objects to save and restore (anything with ``state_dict``, tensors,
        mappings of plain values).
    :param job_id: The job's id in the daemon and the durable store; default ``$SPOTGUARD_JOB_ID``,
        else one derived from the command line and working directory.
    :param keep: Committed checkpoints kept in ``root`` (older ones are deleted).
    :param save_every: Save every this many steps; default: ``cadence``, else
        ``$SPOTGUARD_SAVE_EVERY``, else Young/Daly from the measured save cost and the MTBF.
    :param cadence: A :class:`~spotguard.cadence.Cadence` that decides when to save (not with
        ``save_every``).
    :param save_margin: Seconds kept free between an emergency save's expected end and the
        notice's deadline; a save that does not fit is skipped.
    :param stop_lead: Seconds before the latest safe stop at which a far-off notice stops the loop.
    :param exit_on_stop: Raise ``SystemExit(75)`` on a stop (default); False ends the iteration
        and sets :attr:`stopped`.
    :param daemon: Listen to the node's daemon (notices, commit reports, learned MTBF); False:
        signals only.
    :param signal_deadlines: Seconds from each stop signal to the kill (None: no deadline).
    :param process_group: The ``torch.distributed`` group the ranks agree in; default the world
        group when distributed runs.
    :param on_commit: Called with each :class:`~spotguard.checkpoint.CommitInfo` once a save is
        committed.
    :param guard: A :class:`~spotguard.guard.Guard` to use instead of building one (``daemon`` and
        ``signal_deadlines`` are then its own).
    :param durable: URL of the durable store a fresh node restores from; default
        ``$SPOTGUARD_STORAGE__URL``, else the daemon's.
    :param peer_timeout: Seconds after which a lost peer rank ends the process with 77 (None: off).
    :param abandon_between_steps: On a notice outside a step (an evaluation), exit 75 right after
        the emergency save beside that work, rather than at its next heartbeat, step or boundary.
    :param agree_at_heartbeat: With several ranks, agree on notices at :meth:`heartbeat` calls
        (every rank must make the same calls).
    :param fresh: Start over: remove the root's committed checkpoints and restore nothing; default
        ``$SPOTGUARD_FRESH=1``. Refused while the durable store holds the job's checkpoints (give
        the new run its own ``job_id``).
    """

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
        agree_at_heartbeat: bool = False,
        fresh: bool | None = None,
    ) -> None:
        self.state = build_state(model, optimizer, scheduler, sampler, state)
        self.state.update(_ddp.entries(self.state))  # DDP's real bucket layout, for an exact resume
        if stop_lead < 0:
            raise ValueError("stop_lead must be >= 0")
        if loader is not None:
            self.state.setdefault("loader", loader_entry(loader))
        self.save_margin, self.stop_lead, self.exit_on_stop = save_margin, stop_lead, exit_on_stop
        self._far_notices: set[str] = set()
        process_group = default_group(process_group)
        job_id, given = _jobid.resolve(job_id)
        derived = not given
        # Before anything that makes a group or a thread: a refusal here leaves nothing behind
        # (a private gloo group leaked by a refused Run once aborted its rank at exit).
        self.job_id = job_id = _jobid.agree(job_id, given=given, process_group=process_group)  # rank 0's
        self.agreement = Agreement(process_group, timeout=peer_timeout)
        self.peer_timeout = peer_timeout
        stalled = (f"no step boundary for {(peer_timeout or 0) + PEER_LOST_GRACE:.0f} s (Run(peer_timeout="
                   f"{peer_timeout})), and this rank was waiting neither for its loader nor for its own save: "
                   "a peer rank is probably gone")
        self._progress = (Watchdog(EXIT_PEER_LOST, stalled, before_exit=self._record_forced_exit,
                                   probe=LocalHangs(self, peer_timeout, rank()).probe)
                          if peer_timeout and self.agreement.enabled else None)
        self.cadence = make_cadence(save_every, cadence)
        self._cadence_source = cadence_source(save_every, cadence)
        self._user_on_commit = on_commit
        log.info("job id %s%s", job_id, " (derived from the command line and working directory; pass "
                 "job_id= to choose one)" if derived else "")
        try:
            self.checkpointer = Checkpointer(root, keep=keep, job_id=job_id, process_group=process_group,
                                             on_commit=self._on_commit)
        except OSError as exc:  # the root cannot be made (a read-only file system)
            raise _root.StartRefused(_root.unwritable(Path(root).absolute(), exc)) from None
        self._root_lock = None
        alone = unjoined_ranks() if process_group is None else None
        if self.checkpointer._leads:  # one process per root: writable, and no other launch on it
            _root.probe(self.checkpointer.root)
            try:
                self._root_lock = _root.hold(self.checkpointer.root, job_id)
            except _root.StartRefused as refused:  # another rank of the same launch holds it
                if alone is None:
                    raise
                raise _root.StartRefused(f"{alone}. Here they share the checkpoint root "
                                         f"{self.checkpointer.root}, and it is taken") from refused
        if alone is not None:
            log.warning("%s", alone)
        self.fresh = fresh_requested(fresh)
        self.guard = guard or Guard(job_id=job_id, rank=rank(), daemon=daemon,
                                    signal_deadlines=signal_deadlines, nodes=job_nodes())
        self._job_id, self._durable = job_id, durable
        self.record = Recorder(rank=rank(), job=job_id)
        self._audit = Audit(self.record, self.state)  # samples per step, state left out
        self._save_kinds: dict[int, str] = {}
        self._save_reached: dict[int, datetime] = {}
        """Step saved -> when the loop reached it, for the daemon's goodput (the commit comes later)."""
        self._fixed_cadence = self._cadence_source in ("save_every", "env")  # a fixed step count
        self._due_latched = False
        self.hold_saves = False
        """Set by a framework's callback before a boundary whose state it cannot resume from as the
        run went on (Lightning: a batch after which it validates or ends the epoch): a periodic or
        requested save due there is taken at the next boundary, and never held twice in a row. A
        stop still saves there. It must be the same on every rank (a fixed cadence saves without an
        exchange)."""
        self._held = False  # a save was held at the last boundary
        self.step = self.start_step = 0
        self.stopped = False
        self.resumed_from: Any = None
        self._restored_from: str | None = None
        self._tier: str | None = None
        """Where the resumed step came from when not from this node's disk: ``peer`` or ``bucket``."""
        """Where the checkpoint resumed from came from, when the durable store (a fresh node)."""
        self._saved_step: int | None = None
        self._last_boundary: float | None = None
        self._pending_observation = False
        self._closed = False
        self._open_step: tuple[int, Any] | None = None  # (optimizer steps, loader state) at a yield
        self._optimizer_steps = 0
        self._counts_steps = count_steps(optimizer, self._count_optimizer_step)
        self._between = Between(self, optimizer, abandon_between_steps, agree_at_heartbeat)  # outside a step
        self._heartbeats = Heartbeats(self, agree_at_heartbeat)  # several ranks: agreed at run.heartbeat()

    # ------------------------------------------------------------------ the loop

    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers still to run, resuming after the latest committed checkpoint."""
        self._between.starting(total)
        if self.fresh:
            start_fresh(self)
        else:
            restore_from_store(self)
        try:
            self.resumed_from = load_latest(self)
        except Exception as exc:
            self.record.emit("load_failed", error=f"{type(exc).__name__}: {exc}")
            raise
        self.step = self._saved_step = self.resumed_from.step if self.resumed_from else 0
        self.start_step = self.step
        if self.resumed_from is not None:
            log.info("resumed from step %d (%s)", self.step, self.resumed_from.path)
            _ddp.restore(self.state)  # DDP's recorded buckets: the next steps all-reduce as if never stopped
            self.guard.report_resume(self.step, self._resume_tier())
        if rank() == 0:
            console.info("%s", start_line(self.job_id, self.step, self.resumed_from, self._restored_from,
                                          plan(self.cadence)))
        self.record.start(root=self.checkpointer.root, world_size=self.checkpointer.world_size,
                          resumed_from=self.start_step if self.resumed_from else None,
                          skipped=self.checkpointer.skipped, total=total, entries=sorted(self.state),
                          loaded_digest=getattr(self.resumed_from, "digest", None),
                          cadence=self._cadence_source,
                          daemon=getattr(self.guard, "_link", None) is not None,
                          tier=self._resume_tier())
        if self.step >= total:
            log.info("already finished: step %d of %d is committed; nothing to run", self.step, total)
            return  # a completed job relaunched under a pending notice must exit 0, not 75
        self._heartbeats.active = True
        try:
            if self._at_boundary(self.step):
                return
            while self.step < total:
                self._open_step = (self._optimizer_steps, self._loader_mark())
                began = time.perf_counter()
                yield self.step
                self.checkpointer.observe_step(time.perf_counter() - began)  # steers the save's CPU budget
                self._open_step = None
                self.step += 1
                if self._at_boundary(self.step):
                    return
        finally:  # the loop ended, or was left (break closes this generator)
            self._heartbeats.active = False
            if self._progress is not None:
                self._progress.disarm()

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
        it returns False, after telling the peer-loss progress watchdog this rank is busy, not stuck.
        With several ranks and ``agree_at_heartbeat=True`` the ranks agree here on a notice and stop
        together, saving the last step done (:mod:`spotguard._heartbeat`)."""
        outcome = self._between.wait()
        if outcome is not None:
            return self._stop_between(outcome)
        if self._progress is not None and self._progress.armed_at is not None:
            self._progress.reset(time.monotonic() + self.peer_timeout + PEER_LOST_GRACE)
        return self._heartbeats.beat()

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
        return loader.state_dict() if is_spotguard_loader(loader) else None

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
            _root.release(self._root_lock)
            self.guard.close(exiting=exiting)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        elif is_peer_failure(exc):  # the loop's own collective (DDP's backward) met a lost peer
            self._peer_lost(self.step, exc)
        else:
            if exc_type is not SystemExit:
                self._stop_on_lost_loader(exc)  # a loader's workers killed by the stop's signal: 75
            self.close(exiting=isinstance(exc, SystemExit))

    # ------------------------------------------------------------------ boundaries

    def _at_boundary(self, done: int) -> bool:
        """A boundary: stop when a save ran beside the work since the last one, else act on it."""
        if self.stopped:  # stopped at a heartbeat, exit_on_stop=False
            return True
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
        held, self._held = self._held, False
        hold = self.hold_saves and not held  # a save waits one boundary at most
        due = self.cadence.due(done) or held  # asked at every boundary: its count moves alike everywhere
        if due and self._fixed_cadence:
            self._held = hold
            if not hold:
                self._save(done)  # a fixed step count is due at the same step on every rank
        else:
            self._due_latched |= due and rank() == 0  # rank 0's cadence (the daemon's MTBF) decides
        # flags wait for the next exchange, so every rank acts at the same step; after a held save
        # every rank exchanges at once (the next scheduled exchange could fall on a held boundary too)
        if self.agreement.enabled and not self.agreement.due(done) and not held:
            return False
        try:
            decision = self.agreement.agree(done, self._local_decision(done), self._heartbeats.boundary_marks())
        except PeerLostError as exc:
            self._peer_lost(done, exc)
        self._heartbeats.check_boundary(decision, done)
        self._due_latched = False
        if hasattr(self.cadence, "floor"):  # the slowest node's time to durable (several nodes)
            self.cadence.floor(decision.durable_seconds)
        if decision.stop:
            return self._stop(done, decision)
        if decision.checkpoint and hold:
            self._due_latched = self._held = True  # every rank proposes it at the next exchange
        elif decision.checkpoint and self._saved_step != done:
            self._save(done, "requested")
            self.guard.clear_checkpoint_request()
        return False

    def _peer_lost(self, done: int, exc: PeerLostError) -> NoReturn:
        """Say why, record it, and end the process now (see the module docstring: no teardown)."""
        exit_peer_lost(exc, self.record, done)

    def _resume_tier(self) -> str | None:
        """Where the resumed step came from: ``local``, ``peer`` or ``bucket`` (None: a fresh start).
        The node leader fetched it; the other ranks of the node read its marker."""
        if not self.resumed_from:
            return None
        return fetched_tier(getattr(self.resumed_from, "path", None)) or self._tier or "local"

    def _save(self, done: int, kind: str = "periodic", state: Mapping[str, Any] | None = None) -> None:
        """Save ``state`` (default: the run's) as step ``done``; an emergency save commits first."""
        self._save_kinds[done] = kind
        self._save_reached[done] = utcnow()
        _ddp.settle(self.state)  # every rank: DDP's due bucket rebuild happens before the snapshot
        frozen = state.get("rng") if state is not None else None  # a save beside an evaluation: its RNG
        self._audit.saving(done, frozen.state_dict() if isinstance(frozen, Frozen) else None)  # the marks
        self.checkpointer.save(done, self.state if state is None else state, blocking=kind == "emergency")
        self._saved_step = done
        self.cadence.mark_saved(done)

    def _on_commit(self, info: Any) -> None:
        """Runs in the checkpointer's persist thread: report, and let the main thread observe."""
        self._pending_observation = True
        stats = self.checkpointer.stats
        plan = {"mtbf_s": round(self.cadence.mtbf_s, 3), "mtbf_source": self.cadence.mtbf_source} \
            if isinstance(getattr(self.cadence, "mtbf_s", None), (int, float)) else {}
        self.record.emit("commit", step=info.step, kind=self._save_kinds.pop(info.step, "periodic"),
                         digest=info.digest, path=str(info.path), bytes=stats.bytes,
                         blocking_s=round(stats.blocking_seconds, 6), persist_s=round(stats.persist_seconds, 6),
                         **plan)
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
        if hasattr(self.cadence, "floor") and not self.agreement.enabled:
            self.cadence.floor(getattr(self.guard, "durable_s", None))  # what the store can take
        if self._pending_observation:
            self._pending_observation = False
            stats = self.checkpointer.stats
            if (stats.blocking_seconds or 0) + (stats.persist_seconds or 0) > 0:
                self.cadence.observe_save(stats.blocking_seconds or 0.0, stats.persist_seconds or 0.0)

    def expected_save_seconds(self) -> float | None:
        """Expected notice-to-committed seconds of an emergency save now: the state's bytes (the
        last save's, else counted) at the emergency path's measured bandwidth, which periodic saves
        seed and each emergency save updates (:meth:`Checkpointer.emergency_seconds`)."""
        size = self.checkpointer.stats.bytes or state_bytes(self.state)
        return self.checkpointer.emergency_seconds(size) if size else None
