"""The client's view of interruption notices: from the daemon, or from a signal, as one ``Notice``.

A :class:`Guard` learns of an interruption in two ways, whichever comes first:

* from the local daemon over ZeroMQ (:mod:`spotguard._daemon_client`), when one is reachable;
* from ``SIGTERM``, ``SIGUSR1`` or ``SIGINT`` (Ctrl-C: exit 130, a second one aborts) sent to this process (Kubernetes, Slurm ``--signal``, RunPod,
  ``docker stop``, or the daemon's own signal delivery). A signal becomes a *local* notice whose
  deadline is ``signal_deadlines[signum]`` seconds after it arrived (``None``: no deadline). With
  the default deadlines, SIGTERM's is ``$SPOTGUARD_SIGNAL__GRACE`` when set (the daemon's
  ``signal.grace``: one variable in a pod spec sets both, e.g. GKE Spot's 120 s), else 30 s.

One notice per event, whichever channel brought it: the daemon's signal fallback (``daemon_signal``,
SIGUSR1) means "ask the daemon". While the daemon is reachable the guard asks it for its pending
notices, and when one of them stops this process the signal adds nothing: its notice, with its real
deadline, is already held and a cancel from the platform clears it. The daemon's ``status`` also
lists the notices it recently signalled for, cancelled ones included, so a signal whose notice was
withdrawn before the guard handled it (announced, then cancelled 50 ms later) adds nothing either.
Only a ``daemon_signal`` that no recent daemon notice explains (Slurm ``--signal=USR1``, ``scancel
--signal``) becomes a local notice, and every other signal (SIGTERM from a kubelet or ``docker stop``) always does.

The signal handlers only append to a list; a background thread (and every read of :attr:`notice`)
turns that into a notice. Nothing else happens in a handler: no I/O, no locks, no ``sys.exit``,
because a handler runs between two bytecodes of whatever the main thread was doing. A Guard made
outside the main thread (Ray Train's loop, a notebook's or a server's thread) cannot install handlers:
it registers with the daemon as not handling its signal (SIGUSR1, whose default action would kill
the process), so the daemon never sends it, and the notice comes over ZeroMQ only.

Contract:

* :attr:`stop_requested` is True while a terminating notice is pending (advisory ones too when
  ``stop_on_advisory``). The training loop checks it at step boundaries and stops cleanly.
* Advisory notices (``terminating=False``, e.g. AWS rebalance) raise :attr:`checkpoint_requested`
  once (when ``checkpoint_on_advisory``) so the loop can checkpoint early.
* A ``cancel`` event removes its notice, unless :meth:`begin_stop` was already called: a stop
  that began is finished.
* Every stopping notice arms the forced-exit :class:`~spotguard._watchdog.Watchdog` at its deadline
  minus ``force_exit_margin`` (``force_exit_timeout`` after it arrived when it has no deadline).
* Notices named in ``$SPOTGUARD_HANDLED_NOTICES`` (comma-separated ids) are ignored: ``spotguard
  run`` sets it when it relaunches the job after a drill or manual stop that the daemon still
  holds, which an earlier launch of the same job already obeyed.
* The notice timeline: the background thread tells the daemon when this process set its stop flag
  for each daemon notice (``ack``), and :meth:`report_safe` carries the client's side of the stop
  (step, save outcome, the estimate that decided it, commit time) for the daemon's record.
* Training never fails because the daemon is absent or restarts: requests time out quickly and
  report ``False``. A commit report that got no answer is kept (the newest ``MAX_UNSENT_COMMITS``)
  and sent again by the background thread once the daemon answers, so a checkpoint committed while
  the daemon was down or restarting is still made durable; an error reply drops it (logged).
* Rank 0 reports its progress (:meth:`report_progress`, called at every step boundary: it only
  notes the step and the time) and the background thread sends the newest one to the daemon at
  most every ``progress_interval`` seconds (``$SPOTGUARD_PROGRESS_SECONDS``, default 5), and once
  more at :meth:`close`. A step never waits for the daemon; a report that got no answer is
  tried again an interval later, or replaced by a newer one. The reply carries the MTBF the daemon
  learned for the job (:attr:`job_rate`, a :class:`~spotguard.protocol.JobRate`), which
  ``spotguard.Run``'s cadence plans with.

Exceptions: none of its own; it raises only for invalid arguments (``ValueError``).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import weakref
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

from pydantic import ValidationError

from spotguard import _exit, _record, _worker_signals
from spotguard._daemon_client import DaemonLink
from spotguard._watchdog import Watchdog
from spotguard.exit_codes import EXIT_FORCED
from spotguard.protocol import (AckRequest, CancelEvent, CommitRequest, DurableEvent, JobRate, Kind, Notice,
                                NoticeEvent, ProgressRequest, RegisterRequest, SafeRequest, StatusRequest,
                                utcnow)

__all__ = ["Guard", "DEFAULT_SIGNAL_DEADLINES"]

log = logging.getLogger(__name__)

MAX_UNSENT_COMMITS = 16
"""Commit reports kept for re-sending while the daemon does not answer (the oldest go first)."""
RESEND_SECONDS = 1.0
"""How often the background thread retries the kept commit reports."""
_UNANSWERED_SAID = False
"""Whether this process said that no daemon answered a commit (said once until one answers)."""

PROGRESS_ENV = "SPOTGUARD_PROGRESS_SECONDS"
DEFAULT_PROGRESS_SECONDS = 5.0
"""How often rank 0 tells the daemon its progress: the figures of steps lost at a stop are lower
bounds by up to this much; each report is one small request from the background thread."""

HANDLED_ENV = "SPOTGUARD_HANDLED_NOTICES"
"""Ids of notices an earlier launch of this job already stopped for (set by ``spotguard run``)."""

DEFAULT_SIGNAL_DEADLINES: Mapping[int, float | None] = {signal.SIGTERM: 30.0, signal.SIGUSR1: None}
"""SIGTERM: Kubernetes' default grace period is 30 s. SIGUSR1: a stop request with no deadline.
SIGINT (Ctrl-C), whatever the mapping says unless it names SIGINT itself, while Python's own
handler is installed: a stop with no deadline, the step reached is saved and the process exits
130; a second SIGINT raises ``KeyboardInterrupt`` at once (:func:`spotguard._exit.interrupt`)."""
TORCHRUN_ECHO_S = 2.0
"""Under torchrun, a second SIGINT this soon after the first is the agent passing the terminal's
Ctrl-C on (it sends the ranks the signal it got), not a second Ctrl-C."""
SIGNAL_SLACK_S = 30.0
"""A daemon signal handled up to this long after its notice was cancelled is still the daemon's."""
GRACE_ENV = "SPOTGUARD_SIGNAL__GRACE"
"""Seconds from SIGTERM to the kill, shared with the daemon's ``signal.grace`` setting."""


_LIVE: "weakref.WeakSet[Guard]" = weakref.WeakSet()


def _forked_child() -> None:
    """In every child forked from this process: drop the Guards' inherited signal handlers (the
    child's own handlers from before them come back; no thread of the child would read what they
    note), after telling spotguard._worker_signals whether the parent was guarded."""
    try:
        _worker_signals.forked(any(guard._previous for guard in list(_LIVE)))
        for guard in list(_LIVE):
            guard._restore_handlers()
    except Exception:  # noqa: BLE001  (a fork hook must never fail the fork)
        log.debug("restoring the signal handlers in a forked child failed", exc_info=True)


os.register_at_fork(after_in_child=_forked_child)


def stop_pending() -> bool:
    """Whether a Guard of this process holds a stop (a notice, or a signal it caught): what lets
    :class:`spotguard.DataLoader` start its workers again when they died of that signal."""
    return any(guard.stop_requested for guard in list(_LIVE))


class Guard:
    """Watches for interruption notices in a background thread; see the module docstring.

    :param job_id: The job this process belongs to, as registered with the daemon.
    :param rank: This process's rank (default: the distributed rank, else ``$RANK``, else 0).
    :param daemon: Listen to the daemon; False: signals only.
    :param pub_endpoint: The daemon's event socket (default: from the settings and environment).
    :param request_endpoint: The daemon's request socket (default: from the settings and
        environment).
    :param signal_deadlines: Seconds from each stop signal to the kill (None: no deadline); the
        signals handled.
    :param stop_on_advisory: Stop on advisory notices too (an AWS rebalance recommendation).
    :param checkpoint_on_advisory: Raise :attr:`checkpoint_requested` on an advisory notice.
    :param force_exit: Arm the forced-exit watchdog on a stop (exit 76 when the loop does not end
        in time).
    :param force_exit_margin: Seconds before the deadline at which the watchdog ends the process.
    :param force_exit_timeout: Seconds after a notice without a deadline at which it does.
    :param request_timeout: Seconds a request to the daemon may take.
    :param daemon_signal: The daemon's delivery signal, meaning "ask the daemon" (None: none).
    :param progress_interval: Seconds between rank 0's progress reports (default
        ``$SPOTGUARD_PROGRESS_SECONDS``, else 5).
    :param nodes: Nodes the job spans, reported to the daemon for its MTBF.
    """

    def __init__(
        self,
        *,
        job_id: str = "",
        rank: int | None = None,
        daemon: bool = True,
        pub_endpoint: str | None = None,
        request_endpoint: str | None = None,
        signal_deadlines: Mapping[int, float | None] = DEFAULT_SIGNAL_DEADLINES,
        stop_on_advisory: bool = False,
        checkpoint_on_advisory: bool = True,
        force_exit: bool = True,
        force_exit_margin: float = 2.0,
        force_exit_timeout: float = 120.0,
        request_timeout: float = 0.5,
        daemon_signal: int | None = signal.SIGUSR1,
        progress_interval: float | None = None,
        nodes: int = 1,
    ) -> None:
        if force_exit_margin < 0 or force_exit_timeout <= 0:
            raise ValueError("force_exit_margin must be >= 0 and force_exit_timeout > 0")
        self._progress_interval = _progress_interval(progress_interval)
        self.job_id = job_id
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self._signal_deadlines = _with_interrupt(_with_grace(signal_deadlines))
        self._echo_s = TORCHRUN_ECHO_S if os.environ.get("TORCHELASTIC_RUN_ID") else 0.0
        self._daemon_signal = daemon_signal
        self._stop_on_advisory, self._checkpoint_on_advisory = stop_on_advisory, checkpoint_on_advisory
        self._margin, self._timeout = force_exit_margin, force_exit_timeout
        forced = "clean stop overran its deadline"
        record = _record.Recorder(rank=self.rank, job=job_id)  # so tools tell a forced exit from a crash
        self._watchdog = (Watchdog(EXIT_FORCED, forced, before_exit=lambda: record.emit("forced_exit", reason=forced))
                          if force_exit else None)
        self._lock = threading.RLock()
        self._take_lock = threading.Lock()
        self._notices: dict[str, Notice] = {}
        self._handled = frozenset(filter(None, os.environ.get(HANDLED_ENV, "").split(",")))
        self._force_at: dict[str, float] = {}
        self._flagged: dict[str, datetime] = {}
        """When this process set its stop flag for each notice (first seen)."""
        self._acks: list[str] = []
        self._durable: dict[str, int] = {}
        """Newest durable step per job, from the daemon's ``durable`` events."""
        self._checkpoint_ids: set[str] = set()
        self._signals: list[tuple[int, float]] = []
        self._signal_count = 0
        self._stopping = False
        self._unsent: dict[tuple[str, str], CommitRequest] = {}
        self._commit_refusals: set[str] = set()
        self._told_no_root = False
        self._resend_at = 0.0
        self._progress: tuple[int, datetime] | None = None
        self._progress_sent: tuple[int, datetime] | None = None
        self._progress_at = 0.0
        self.progress_acknowledged: int | None = None
        """The newest step the daemon acknowledged in a progress report (None before the first)."""
        self.nodes = nodes
        self._answered = False
        """Whether a daemon answered a commit of this process (then one that stops answering is down)."""
        self.durable_s: float | None = None
        """Seconds this node's daemon takes to make a commit of the job durable (median of its last
        uploads; None: unknown): the cadence never saves faster than that."""
        self.job_rate: JobRate | None = None
        """The daemon's estimate of this job's interruption rate, from its newest progress reply."""
        self._previous: dict[int, Any] = {}
        self._closed = threading.Event()
        self._link = None
        self._install_handlers()  # before registering: whether it handles the daemon's signal
        if daemon:
            self._link = DaemonLink(self._on_event, job_id=job_id, rank=self.rank,
                                    pub_endpoint=pub_endpoint, request_endpoint=request_endpoint,
                                    request_timeout=request_timeout, signal=self.handles_daemon_signal)
            self._link.connect()
        self._thread = threading.Thread(target=self._loop, name="spotguard-guard", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # ------------------------------------------------------------------ state

    @property
    def notice(self) -> Notice | None:
        """The most urgent pending notice: terminating first, then the earliest deadline."""
        self._take_signals()
        with self._lock:
            if not self._notices:
                return None
            return min(self._notices.values(), key=_urgency)

    @property
    def stop_requested(self) -> bool:
        """True while a notice asks this process to stop (see ``stop_on_advisory``)."""
        self._take_signals()
        with self._lock:
            return any(self._stops(n) for n in self._notices.values())

    @property
    def checkpoint_requested(self) -> bool:
        """True after an advisory notice, until :meth:`clear_checkpoint_request`."""
        with self._lock:
            return bool(self._checkpoint_ids)

    def clear_checkpoint_request(self) -> None:
        with self._lock:
            self._checkpoint_ids.clear()

    @property
    def daemon_alive(self) -> bool:
        return self._link is not None and self._link.alive

    def seconds_left(self) -> float | None:
        """Seconds until the most urgent notice's deadline; None without a notice or a deadline."""
        notice = self.notice
        return None if notice is None else notice.seconds_left()

    @property
    def forced_exit_at(self) -> float | None:
        """The ``time.monotonic()`` instant of the forced exit (76), None while none is armed."""
        return None if self._watchdog is None else self._watchdog.armed_at

    def begin_stop(self) -> None:
        """Mark the clean stop as begun: from now on a cancel no longer clears the notice."""
        with self._lock:
            self._stopping = True

    # ------------------------------------------------------------------ reports to the daemon

    def flagged_at(self, notice_id: str) -> datetime | None:
        """When this process set its stop flag for the notice (None: not held)."""
        with self._lock:
            return self._flagged.get(notice_id)

    def report_safe(self, **stop: Any) -> bool:
        """Tell the daemon this process is safe for the pending notices; False if none answered.

        ``stop``: the client's side of the stop for the notice timeline, as :class:`SafeRequest`
        names it (``step``, ``stopped_at``, ``save``, ``estimate_s``, ``seconds_left``,
        ``committed_at``); the flag's time is added here."""
        with self._lock:
            ids = [n.id for n in self._notices.values() if n.platform != "local"][:64]
            flagged = [self._flagged[i] for i in ids if i in self._flagged]
        try:
            message = SafeRequest(pid=os.getpid(), notice_ids=ids, flagged_at=min(flagged) if flagged
                                  else None, **stop)
        except ValidationError as exc:  # a figure out of the protocol's bounds: report safe anyway
            log.debug("stop details left out of the safe report: %s", exc)
            message = SafeRequest(pid=os.getpid(), notice_ids=ids)
        return self._request(message)

    def durable_step(self, job_id: str | None = None) -> int | None:
        """The newest step of ``job_id`` (default: this guard's job) that the daemon made durable.

        Told by the daemon's ``durable`` events; asked with ``status`` when none was heard yet (a
        restarted process). None without a daemon or before the first upload finished."""
        job = (self.job_id if job_id is None else job_id) or "default"
        with self._lock:
            known = self._durable.get(job)
        if known is None:
            durable = ((self.daemon_status() or {}).get("uploads") or {}).get("durable") or {}
            known = (durable.get(job) or {}).get("step")
        return known

    @property
    def daemon_mtbf(self) -> tuple[float, str] | None:
        """The node MTBF (seconds) the daemon's cadence prior assumes and where it comes from (a
        setting, or :data:`spotguard.cadence.DEFAULT_MTBF_SOURCE`), from its register reply; None
        without a daemon (or an older one). A job's is it divided by its nodes (``cadence.job_mtbf``)."""
        mtbf = self._link.registered.get("mtbf") if self._link is not None else None
        try:
            return float(mtbf["node_prior_s"]), str(mtbf["source"])
        except (KeyError, TypeError, ValueError):
            return None

    def daemon_status(self) -> dict[str, Any] | None:
        """The daemon's ``status`` reply data (notices, clients, uploads), or None without a daemon."""
        if self._link is None or not self._link.alive:
            return None
        reply = self._link.request(StatusRequest())
        return reply.data if reply is not None and reply.ok else None

    @property
    def handles_daemon_signal(self) -> bool:
        """Whether this process's handler takes the daemon's signal (SIGUSR1, or ``daemon_signal``):
        False outside the main thread (no handler installed), where that signal's default action
        would kill it; the daemon is told so when it registers and then never signals it."""
        return self._handles_daemon_signal

    def report_resume(self, step: int, tier: str | None = None) -> bool:
        """Tell the daemon this process resumed from the checkpoint of ``step`` (a restart, for its
        goodput metrics) by registering again with ``resumed_from_step``; ``tier``: where that
        checkpoint came from (``local``, ``peer`` or ``bucket``, :data:`~spotguard.protocol.RESUME_TIERS`;
        None when not known: the daemon counts it as ``unknown``). False if none answered."""
        return self._request(RegisterRequest(pid=os.getpid(), rank=self.rank, job_id=self.job_id,
                                             resumed_from_step=step, resumed_tier=tier,
                                             signal=self.handles_daemon_signal))

    def report_commit(self, info: Any, save_seconds: float | None = None,
                      reached_at: datetime | None = None) -> bool:
        """Tell the daemon a checkpoint was committed (a ``CommitInfo``), how long the loop was
        blocked saving it and when the loop reached its step (aware); False if none answered."""
        files = info.files if isinstance(info.files, int) else len(info.files)
        message = CommitRequest(pid=os.getpid(), job_id=self.job_id, path=str(info.path), step=info.step,
                                size_bytes=int(info.size_bytes or 0), files=files, save_seconds=save_seconds,
                                reached_at=reached_at)
        if self._link is None:
            return False
        if "checkpoint_root" in self._link.registered and self._link.registered["checkpoint_root"] is None:
            if not self._told_no_root:  # the daemon watches no root: nobody asked for uploads
                self._told_no_root = True
                log.info("the daemon watches no checkpoint root: checkpoints stay local (start it with "
                         "--checkpoint-root DIR to make them durable)")
            return False
        reply = self._link.request(message) if self._link.alive else None
        self._answered = self._answered or reply is not None
        if reply is None:
            self._keep_unsent(message)
        elif not reply.ok:  # loud once per cause (a daemon without checkpoint_root refuses every one)
            level = logging.DEBUG if reply.error in self._commit_refusals else logging.WARNING
            if len(self._commit_refusals) < 100:
                self._commit_refusals.add(reply.error)
            log.log(level, "the daemon refused checkpoint %s: %s", message.path, reply.error)
        return reply is not None and reply.ok

    def report_progress(self, step: int) -> None:
        """Note that ``step`` steps are done (rank 0 only); the background thread sends it. Cheap:
        called at every step boundary, it takes no lock and does no I/O."""
        if self.rank == 0 and self._link is not None and (self._progress is None or self._progress[0] != step):
            self._progress = (step, utcnow())

    def _send_progress(self, *, now: bool = False) -> None:
        """Send the newest progress if it is new and the interval passed (guard thread)."""
        progress = self._progress
        if progress is None or progress == self._progress_sent or self._link is None \
                or not self._link.alive or (not now and time.monotonic() < self._progress_at):
            return
        self._progress_at = time.monotonic() + self._progress_interval
        reply = self._link.request(ProgressRequest(pid=os.getpid(), job_id=self.job_id, step=progress[0],
                                                   at=progress[1], nodes=self.nodes))
        if reply is not None:  # answered: not sent again (no answer: tried again next interval)
            self._progress_sent = progress
            if reply.ok:
                self.progress_acknowledged = progress[0]
                self.job_rate = _job_rate(reply.data.get("rate")) or self.job_rate
                self.durable_s = _seconds(reply.data.get("durable_s")) or self.durable_s

    def _keep_unsent(self, message: CommitRequest) -> None:
        global _UNANSWERED_SAID
        with self._lock:
            self._unsent[(message.job_id, message.path)] = message
            while len(self._unsent) > MAX_UNSENT_COMMITS:
                self._unsent.pop(next(iter(self._unsent)))
        if not _UNANSWERED_SAID:  # once per process until a daemon answers, not per checkpoint
            _UNANSWERED_SAID = True
            if self._answered or self.nodes > 1:  # a daemon that was there (or a fleet's) is down
                log.warning("no daemon answered the commit of step %d: this node's daemon is down, so its "
                            "checkpoints are not made durable and, on node-local roots, no step after the "
                            "last global one becomes global (a relaunch resumes from there); commits are "
                            "kept (the newest %d) and announced when it answers", message.step,
                            MAX_UNSENT_COMMITS)
            else:
                log.info("no daemon answered the commit of step %d; commits are kept (the newest %d) and "
                         "announced when one answers", message.step, MAX_UNSENT_COMMITS)

    def _resend_commits(self) -> None:
        """Re-announce kept commit reports, oldest first, while the daemon answers (guard thread)."""
        global _UNANSWERED_SAID
        if not self._unsent or self._link is None or not self._link.alive \
                or time.monotonic() < self._resend_at:
            return
        self._resend_at = time.monotonic() + RESEND_SECONDS
        with self._lock:
            pending = list(self._unsent.items())
        for key, message in pending:
            reply = self._link.request(message)
            if reply is None:
                return  # still down: try again later
            with self._lock:
                self._unsent.pop(key, None)
            _UNANSWERED_SAID = False
            if reply.ok:
                log.info("commit of step %d announced again to the daemon", message.step)
            else:
                log.warning("the daemon refused checkpoint %s: %s", message.path, reply.error)

    def _request(self, message: Any) -> bool:
        if self._link is None or not self._link.alive:
            return False
        reply = self._link.request(message)
        return reply is not None and reply.ok

    # ------------------------------------------------------------------ lifecycle

    def close(self, *, exiting: bool = False) -> None:
        """Stop the thread, unregister, restore the previous signal handlers, disarm the watchdog.

        ``exiting=True`` (a clean stop, the process is about to exit) keeps the forced-exit
        watchdog armed, so a hang after this point (a collective in a ``finally``) is still
        bounded, and sets the guarded signals to ``SIG_IGN``, so a late SIGTERM (torchrun
        terminating the sibling ranks, a repeated kubelet signal) cannot cut the exit short and
        turn status 75 into a death by signal. (A Python-level handler would not do: interpreter
        finalisation resets those to the default, which kills.)
        """
        if self._closed.is_set():
            return
        self._closed.set()
        _LIVE.discard(self)  # a closed Guard's stop is over: no longer this process's (stop_pending)
        self._thread.join(timeout=5)
        if self._link is not None:
            self._send_progress(now=True)
            self._link.close()
        if exiting:
            self._ignore_signals()
            return
        self._restore_handlers()
        if self._watchdog is not None:
            self._watchdog.disarm()

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                if self._link is not None:
                    self._link.poll(0.05)
                else:
                    self._closed.wait(0.05)
                self._take_signals()
                self._send_acks()
                self._resend_commits()
                self._send_progress()
            except Exception:  # noqa: BLE001 - the guard must never die silently mid-run
                log.exception("spotguard guard loop error; continuing")
                self._closed.wait(0.5)

    def _send_acks(self) -> None:
        """Tell the daemon when the stop flag was set for its notices (guard thread; one try each:
        the safe report carries the time again)."""
        if not self._acks or self._link is None or not self._link.alive:
            return
        with self._lock:
            ids, self._acks = self._acks[:64], self._acks[64:]
            at = min(self._flagged[i] for i in ids)
        self._link.request(AckRequest(pid=os.getpid(), notice_ids=ids, at=at))

    _handles_daemon_signal = False

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("Guard created outside the main thread: no signal handlers installed; the "
                        "daemon is told not to signal this process (its notices come over ZeroMQ)")
            return
        for signum in self._signal_deadlines:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        self._handles_daemon_signal = (self._daemon_signal or signal.SIGUSR1) in self._previous
        _worker_signals.protect()  # plain loaders' workers outlive a killpg too

    def _ignore_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in self._previous:  # Ctrl-C again still aborts
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_IGN)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and _exit.interrupt(self._echo_s):  # Ctrl-C again: abort at once
            raise KeyboardInterrupt
        self._signals.append((signum, time.time()))  # the only thing a handler does

    def _take_signals(self) -> None:
        """Turn received signals into local notices. A live daemon is asked for its notices first
        (a signal from its delivery can overtake the ZeroMQ event); a ``daemon_signal`` explained by
        one of them adds nothing. A reader arriving meanwhile waits for that answer (at most
        ``request_timeout``)."""
        with self._take_lock:
            if not self._signals:
                return
            if self.daemon_alive:
                self._link.refresh()
            while self._signals:
                signum, at = self._signals.pop(0)
                if signum == self._daemon_signal and self._daemon_explains(at):
                    log.info("%s from the daemon: its notice is already held",
                             signal.Signals(signum).name)
                    continue
                self._signal_count += 1
                self._add_notice(_signal_notice(signum, at, self._signal_deadlines.get(signum),
                                                self._signal_count))

    def _daemon_explains(self, at: float) -> bool:
        """True when the daemon answers and a notice it announced asks this process to stop, or it
        signalled for a notice while that was pending (up to ``SIGNAL_SLACK_S`` before ``at``, when the
        signal was handled: a main thread in a long C call handles it late), even one cancelled since:
        a notice the platform withdrew 50 ms after announcing it must not turn into a stop."""
        if not self.daemon_alive:
            return False
        for signalled_at, cancelled_at in self._link.signalled.values():
            if signalled_at - 1.0 <= at <= (cancelled_at or at) + SIGNAL_SLACK_S:
                return True
        with self._lock:
            return any(n.platform != "local" and self._stops(n) for n in self._notices.values())

    def _on_event(self, event: Any) -> None:
        if isinstance(event, Notice):
            self._add_notice(event)
        elif isinstance(event, NoticeEvent):
            self._add_notice(event.notice)
        elif isinstance(event, CancelEvent):
            self._cancel(event.id, event.reason)
        elif isinstance(event, DurableEvent):
            with self._lock:
                self._durable[event.job_id] = max(event.step, self._durable.get(event.job_id, -1))

    def _stops(self, notice: Notice) -> bool:
        return notice.terminating or self._stop_on_advisory

    def _add_notice(self, notice: Notice) -> None:
        if notice.id in self._handled:
            return
        with self._lock:
            known = self._notices.get(notice.id)
            if known is not None and known.deadline == notice.deadline:
                return
            self._notices[notice.id] = notice
            left = notice.seconds_left()
            say = log.info if notice.id.startswith("local:SIGINT:") else log.warning  # Ctrl-C: one line at the stop
            say("interruption notice %s (%s, %s): %s", notice.id, notice.kind.value,
                "no deadline" if left is None else f"{left:.1f} s left", notice.detail if known is None else "rescheduled")
            if self._stops(notice):
                if notice.id not in self._flagged:
                    self._flagged[notice.id] = utcnow()
                    if notice.platform != "local":
                        self._acks.append(notice.id)
                grace = self._timeout if left is None else left - self._margin
                self._force_at[notice.id] = time.monotonic() + max(grace, 1.0)
                self._rearm()
            elif self._checkpoint_on_advisory:
                self._checkpoint_ids.add(notice.id)

    def _cancel(self, notice_id: str, reason: str) -> None:
        with self._lock:
            if notice_id not in self._notices:
                return
            if self._stopping:
                log.info("notice %s cancelled after the stop began; stopping anyway", notice_id)
                return
            log.warning("notice %s cancelled (%s)", notice_id, reason or "no reason given")
            del self._notices[notice_id]
            self._flagged.pop(notice_id, None)
            self._force_at.pop(notice_id, None)
            self._checkpoint_ids.discard(notice_id)
            self._rearm()

    def _rearm(self) -> None:
        if self._watchdog is None:
            return
        self._watchdog.disarm()
        if self._force_at:
            self._watchdog.arm(min(self._force_at.values()))


def _job_rate(data: Any) -> JobRate | None:
    """The daemon's :class:`JobRate` in a progress reply; None when absent (an older daemon) or
    out of the protocol's bounds (logged at debug)."""
    if data is None:
        return None
    try:
        return JobRate.model_validate(data)
    except ValidationError as exc:
        log.debug("ignoring the daemon's job rate: %s", exc)
        return None


def _seconds(value: Any) -> float | None:
    """A plausible duration from a reply (a finite number of seconds, 0 < s <= 1e6), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e6:
        return None
    return float(value)


def _progress_interval(given: float | None) -> float:
    """``given``, else ``$SPOTGUARD_PROGRESS_SECONDS``, else the default; ValueError unless > 0."""
    if given is None:
        raw = os.environ.get(PROGRESS_ENV, "")
        try:
            given = float(raw) if raw else DEFAULT_PROGRESS_SECONDS
        except ValueError:
            raise ValueError(f"${PROGRESS_ENV}={raw!r} is not a number of seconds") from None
    if not given > 0:
        raise ValueError(f"progress_interval must be > 0 seconds, not {given}")
    return given


def _with_grace(deadlines: Mapping[int, float | None]) -> dict[int, float | None]:
    """``deadlines``, with SIGTERM's from ``$SPOTGUARD_SIGNAL__GRACE`` when they are the defaults;
    ValueError for a value that is not a number of seconds > 0."""
    deadlines, raw = dict(deadlines), os.environ.get(GRACE_ENV, "")
    if raw and deadlines == dict(DEFAULT_SIGNAL_DEADLINES):
        try:
            grace = float(raw)
        except ValueError:
            grace = math.nan
        if not 0 < grace <= 7 * 24 * 3600:
            raise ValueError(f"${GRACE_ENV}={raw!r} is not a number of seconds > 0")
        deadlines[signal.SIGTERM] = grace
    return deadlines


def _with_interrupt(deadlines: dict[int, float | None]) -> dict[int, float | None]:
    """``deadlines`` with SIGINT (no deadline) when they leave it out and Python's default
    handler (``KeyboardInterrupt``) is the one installed: a program or shell that set its own, or
    ignores it, keeps that."""
    if signal.SIGINT not in deadlines and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        deadlines[signal.SIGINT] = None
    return deadlines


def _signal_notice(signum: int, at: float, grace: float | None, count: int) -> Notice:
    name = signal.Signals(signum).name
    received = datetime.fromtimestamp(at, timezone.utc)
    return Notice(id=f"local:{name}:{count}", platform="local", kind=Kind.SIGNAL,
                  received_at=received, source="signal",
                  deadline=None if grace is None else received + timedelta(seconds=grace),
                  detail=f"{name} received by pid {os.getpid()}")


def _urgency(notice: Notice) -> tuple[bool, bool, datetime]:
    far = datetime.max.replace(tzinfo=timezone.utc)
    return (not notice.terminating, notice.deadline is None, notice.deadline or far)
