"""Answers to the protocol's requests: the client registry, safe reports, commits, manual notices.

The server validates every request before it gets here; these methods only decide. They are quick,
do no network I/O (the server answers one request at a time) and cost O(1) amortised: nothing here
walks every client for every request.

Who may do what (the peer's credentials come from :data:`~spotguard_daemon.core.server.current_peer`;
the rules are in :mod:`spotguard_daemon.core.peers`): ``register``, ``unregister`` and ``safe`` only for
the sender's own processes (root: any); a process is signalled only when its owner was proven.
``progress`` likewise names a process of the sender's. ``status``, ``commit`` and ``notify`` are open
to every peer that can reach the socket; ``withdraw`` (``spotguard notices cancel``) only to the
daemon's own user and root, proven over ``ipc://``.

Notices offered to a client (the ``register`` reply, ``status``'s ``notices``) leave out the overdue
ones (:meth:`~.store.NoticeStore.offered`: a job that starts after a deadline is not stopped by it);
``status`` lists those apart, in ``overdue``.

Goodput is fed by proven peers only (``ipc://``, whose credentials the kernel reports): an unproven
(``tcp://``) peer's ``progress`` is refused, and its commits and restarts touch no job's ledger, so
they reach neither the metrics nor the durable store's ``progress.json``. A report may date back no
further than its process's registration, nor more than ``goodput.MAX_REPORT_AGE``.

Registrations are keyed by the process the kernel proves (:func:`~spotguard_daemon.core.peers.key_of`),
never by the pid a client names: two containers' pid 1 are two clients. A process registered again
(a client that resumed, or ``spotguard run``'s registrar naming a client that registered itself)
keeps its first registration time, and its rank and job unless the new request names a job.

Bounds: at most ``MAX_CLIENTS`` registrations (dead ones are reaped a slice at a time by
:meth:`RequestHandler.reap`, and all at once when the table is full) and ``MAX_MANUAL`` pending
manual notices; beyond them a request is refused, so a ``status`` reply stays far below the
clients' 1 MiB limit.

Commits: ``path`` is joined to ``checkpoint_root`` when relative and resolved with ``realpath``
(``..`` and symlinks followed). It must be a committed checkpoint directory strictly below the
resolved root: named ``step-NNNNNNNNNN``, holding a regular ``manifest.json`` whose ``step`` is
the request's. Steps are ordered per job: a step older than one already accepted (or durable) for the
job is refused, never answered ``ok`` and dropped. An accepted commit is passed to
``on_commit(request, resolved_path)``; the storage engine should still open the files with care (the
tree may change after the check).

Goodput: commits, ``progress`` reports and rank-0 restarts feed the
:class:`~spotguard_daemon.core.goodput.GoodputLedger`, whose losses go to the metrics; a restart of a job
the ledger does not know goes to ``recall`` (the durable store's copy, :mod:`.goodput_store`). Every
figure of a restart is counted under the tier its register named (``resumed_tier``: ``local``,
``peer``, ``bucket``; ``unknown`` when left out), on either path. A
register is a restart at most once per registration (a client registers, restores, then registers
again with the step), and only while the job's previous rank 0 is gone (a second process naming a
running job is logged and counts nothing); the ledger then counts an interruption only when the
previous run trained.
The reply to ``progress`` carries the job's learned :class:`~spotguard.protocol.JobRate`
(:mod:`.job_rates`), which ``cadence`` also answers for any job, to any peer; the ``register`` and
``status`` replies carry the node MTBF a job starts from (``mtbf``: ``node_prior_s``, ``source``);
the ``register`` reply also names the ``checkpoint_root`` (None: the daemon watches none, and a
client keeps its checkpoints local without asking).

Exceptions: none; every refusal is an error :class:`~spotguard.protocol.Reply`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Callable

from spotguard.protocol import (
    AckRequest, CadenceRequest, CommitRequest, Kind, NotifyRequest, ProgressRequest, RegisterRequest,
    Reply, Request, SafeRequest, UnregisterRequest, WithdrawRequest,
)
from spotguard.storage.fresh_node import DEFAULT_JOB

from spotguard_daemon.core.goodput import GoodputLedger
from spotguard_daemon.core.job_rates import JobRates
from spotguard_daemon.core.metrics import Metrics
from spotguard_daemon.core.peers import Client, key_of, may_act_for, may_operate, process_start_time
from spotguard_daemon.core.server import current_peer
from spotguard_daemon.core.store import NoticeStore
from spotguard_daemon.core.timeline import BY_OPERATOR, Timelines
from spotguard_daemon.core.watchers import manual
from spotguard_daemon.core.watchers.manual import manual_notice

__all__ = ["Client", "RequestHandler", "checkpoint_dir", "confine", "process_start_time"]

log = logging.getLogger(__name__)

CommitHook = Callable[[CommitRequest, Path], None]
MAX_CLIENTS = 4096
MAX_UNPROVEN = 256
MAX_MANUAL = 32
MAX_JOBS = 4096
MAX_MANIFEST_BYTES = 64 << 20
REAP_BATCH = 256
FULL_REAP_SECONDS = 1.0
_STEP_DIR = re.compile(r"^step-(\d{10})$")


def confine(path: str, root: Path) -> Path:
    """Resolve ``path`` (relative ones against ``root``) and return it if it lies inside ``root``.

    Raises ``ValueError`` naming the problem otherwise (a NUL byte, a name that is not UTF-8 or
    too long too).
    """
    real_root = Path(os.path.realpath(root))
    try:
        resolved = Path(os.path.realpath(root / path))
        str(resolved).encode("utf-8")
        if not resolved.is_relative_to(real_root):
            raise ValueError(f"path {_show(path)} resolves outside the checkpoint root {str(real_root)!r}")
        os.stat(resolved)
    except FileNotFoundError:
        raise ValueError(f"path {_show(path)} does not exist") from None
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not a UTF-8 name"
        raise ValueError(f"path {_show(path)} cannot be used: {reason}") from None
    return resolved


def checkpoint_dir(path: str, root: Path, step: int) -> Path:
    """The committed checkpoint directory ``path`` names, checked against ``step``; else ValueError."""
    resolved = confine(path, root)
    match = _STEP_DIR.match(resolved.name)
    if resolved == Path(os.path.realpath(root)) or not match or not resolved.is_dir():
        raise ValueError(f"path {_show(path)} is not a committed checkpoint directory "
                         "(step-NNNNNNNNNN below the checkpoint root)")
    if int(match.group(1)) != step:
        raise ValueError(f"step {step} does not match the directory {resolved.name}")
    manifest_step = _read_manifest(resolved / "manifest.json").get("step")
    if manifest_step != step:
        raise ValueError(f"step {step} does not match the manifest's step {manifest_step!r}")
    return resolved


def _show(path: str) -> str:
    """``path`` for a message: quoted, escaped, at most about 200 characters."""
    return repr(path if len(path) <= 200 else path[:200] + "...")


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, opened without following links or blocking on a FIFO, size-bounded."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"{path.parent.name} has no readable manifest.json ({exc.strerror}): "
                         "not a committed checkpoint") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MANIFEST_BYTES:
            raise ValueError(f"{path.parent.name}/manifest.json is not a regular file of at most "
                             f"{MAX_MANIFEST_BYTES} bytes")
        data = handle.read(MAX_MANIFEST_BYTES + 1)
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path.parent.name}/manifest.json is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path.parent.name}/manifest.json is not a JSON object")
    return manifest


class RequestHandler:
    """Turns each validated request into a :class:`Reply`; ``info()`` feeds ``status``.

    ``known_step(job_id)`` reports the newest step already durable for a job (the upload queue's),
    so the per-job order survives a restart.
    """

    def __init__(self, store: NoticeStore, *, platform: str, checkpoint_root: Path | None,
                 info: Callable[[], dict[str, Any]], on_commit: CommitHook | None = None,
                 on_change: Callable[[], None] | None = None,
                 known_step: Callable[[str], int | None] | None = None,
                 metrics: Metrics | None = None, ledger: GoodputLedger | None = None,
                 recall: Callable[[str, int, str | None], None] | None = None,
                 rates: JobRates | None = None,
                 timeline: Timelines | None = None,
                 time_to_durable: Callable[[str], float | None] | None = None) -> None:
        self.store = store
        self.time_to_durable = time_to_durable or (lambda job: None)
        """Seconds a job's commit takes to become durable here (the cadence's floor), or None."""
        self.timeline = timeline or Timelines()
        """The notice timeline: clients' flags and safe reports are recorded there (:mod:`.timeline`)."""
        self.metrics = metrics or Metrics()
        self.ledger = ledger or GoodputLedger()
        self.recall = recall or (lambda job, step, tier: None)
        self.rates = rates or JobRates(self.ledger, platform=platform)
        """Called with a restarted job this node knows nothing of, its step and the tier it came from
        (None: not said): the durable store's copy of the job's record counts the loss
        (:mod:`.goodput_store`)."""
        self.clients: dict[int, Client] = {}
        self.on_commit = on_commit or (lambda request, path: None)
        self.platform = platform
        self._root = checkpoint_root
        self._info = info
        self._on_change = on_change or (lambda: None)
        self._known_step = known_step or (lambda job: None)
        self._newest: dict[str, int] = {}
        self._sweep: list[int] = []
        self._unproven: list[int] = []
        self._causes: set[str] = set()
        self._full_reap_at = 0.0

    async def __call__(self, request: Request) -> Reply:
        method = getattr(self, f"_{request.type}")
        return method(request)

    # ------------------------------------------------------------------ registry

    def live_clients(self) -> list[Client]:
        """Registered clients (dead ones are dropped by :meth:`reap`, not here: this is O(1) I/O)."""
        return list(self.clients.values())

    def signallable_pids(self) -> list[int]:
        """Pids that may be signalled now: checked against ``/proc`` one by one."""
        return [c.target for c in self.clients.values() if c.signallable()]

    def signal_refused_pids(self) -> list[int]:
        """Pids of live proven clients that registered as not handling the signal (never signalled,
        not even when a pid file or the cgroup lists them; an unproven one cannot speak for a pid)."""
        return [c.target for c in self.clients.values()
                if not c.handles_signal and c.proven and c.target is not None and c.alive()]

    def reap(self, budget: int = REAP_BATCH) -> int:
        """Check up to ``budget`` registrations (round robin) and drop dead ones; return the count."""
        for _ in range(min(budget, len(self.clients))):
            if not self._sweep:
                self._sweep = list(self.clients)
            pid = self._sweep.pop()
            client = self.clients.get(pid)
            if client is not None and not client.alive():
                log.info("client pid %d is gone; unregistering it", pid)
                del self.clients[pid]
                self._on_change()
        return len(self.clients)

    def _make_room(self, client: Client) -> bool:
        """True when one more client fits, after a full reap (at most once a second) if needed.

        Unproven clients (never signalled) take at most ``MAX_UNPROVEN`` places: beyond that the
        oldest of them is forgotten (nothing can tell whether it is still alive).
        """
        if not client.proven:
            self._unproven = [p for p in self._unproven if p in self.clients and
                              not self.clients[p].proven][-MAX_UNPROVEN:]
            if len(self._unproven) >= MAX_UNPROVEN:
                self.clients.pop(self._unproven.pop(0), None)
            self._unproven.append(client.pid)
        now = time.monotonic()
        if len(self.clients) >= MAX_CLIENTS and now >= self._full_reap_at:
            self._full_reap_at = now + FULL_REAP_SECONDS
            self.reap(len(self.clients))
        return len(self.clients) < MAX_CLIENTS

    # ------------------------------------------------------------------ requests

    def _register(self, request: RegisterRequest) -> Reply:
        try:
            client = Client.register(request.pid, request.rank, request.job_id, current_peer.get(),
                                     handles_signal=request.signal)
        except PermissionError as exc:
            self._refused("register", exc)
            return Reply(ok=False, error=f"register refused: {exc}")
        old = self.clients.get(client.key)
        if old is not None and not old.alive():  # its pid now names another process: forget it
            del self.clients[client.key]
            old = None
        if old is not None and not may_act_for(current_peer.get(), request.pid, old):
            return Reply(ok=False, error=f"register refused: pid {request.pid} is registered by another user")
        if old is None and not self._make_room(client):
            return Reply(ok=False, error=f"register refused: {MAX_CLIENTS} clients are registered")
        if old is not None and old.proven and old.start_time == client.start_time:
            client.registered_at = old.registered_at  # the same process: reports since then stay valid
            client.resumed = old.resumed
            if not request.job_id and request.rank == 0:  # spotguard run's registrar naming a client
                client.rank, client.job_id = old.rank, old.job_id
                client.handles_signal = old.handles_signal and client.handles_signal
        self.clients[client.key] = client
        if client.proven:  # an unproven peer could name any job: it must not count or reset its loss
            self._count_restart(request, client)
        here = f" (pid {client.key} here)" if client.key != request.pid else ""
        log.info("client pid %d%s registered (rank %d, job %r, signal %s)", request.pid, here, client.rank,
                 client.job_id, "yes" if client.uid is not None and client.handles_signal else "no")
        self._on_change()
        return Reply(ok=True, data={"notices": self._notices(), "signal": client.public()["signal"],
                                    "mtbf": self._mtbf(), "checkpoint_root": self._root and str(self._root),
                                    "daemon_id": self._info().get("daemon_id")})

    def _count_restart(self, request: RegisterRequest, client: Client) -> None:
        """Count a rank-0 resume and the committed steps it re-runs, under the tier it came from
        (see :mod:`.metrics`)."""
        key = client.key
        if request.resumed_from_step is None or request.rank != 0:
            return
        job = request.job_id or DEFAULT_JOB
        record = self.ledger.record(job)
        previous = None if record is None or record.pid in (0, key) else self.clients.get(record.pid)
        if client.resumed == job or (previous is not None and previous.alive()):
            log.info("job %r: pid %d registered as rank 0 resumed from step %d while %s; not a restart",
                     job, key, request.resumed_from_step, "its restart was counted already"
                     if client.resumed == job else f"the job's rank 0 (pid {record.pid}) still runs")
            return
        client.resumed = job
        known = self._known_step(job)
        newest = max(self._newest.get(job, -1), -1 if known is None else known)
        tier = request.resumed_tier
        self.metrics.resumed(newest - request.resumed_from_step if newest >= 0 else 0, tier)
        loss = self.ledger.restarted(job, request.resumed_from_step, key)
        if loss is not None:
            self.metrics.lost(loss, tier)
        else:
            self.recall(job, request.resumed_from_step, tier)

    def _unregister(self, request: UnregisterRequest) -> Reply:
        key = key_of(request.pid, current_peer.get())
        client = self.clients.get(key)
        if client is not None and not may_act_for(current_peer.get(), request.pid, client):
            return Reply(ok=False, error=f"unregister refused: pid {request.pid} is not the sender's")
        known = self.clients.pop(key, None) is not None
        self._on_change()
        return Reply(ok=True, data={"known": known})

    def _status(self, _request: Request) -> Reply:
        self.reap()  # a bounded slice: all of a small table, so a dead client is not reported
        safe = {n.id: sorted(self.store.safe_pids(n.id)) for n in self.store.pending()}
        overdue = [n.model_dump(mode="json") for n in self.store.pending() if self.store.overdue(n)]
        data = {**self._info(), "notices": self._notices(), "overdue": overdue, "safe": safe,
                "mtbf": self._mtbf(),
                "clients": [c.public() for c in self.clients.values()], "timeline": self.timeline.current()}
        if getattr(_request, "history", 0):
            data["history"] = self.timeline.history(_request.history)
        return Reply(ok=True, data=data)

    def _safe(self, request: SafeRequest) -> Reply:
        key = key_of(request.pid, current_peer.get())
        if not may_act_for(current_peer.get(), request.pid, self.clients.get(key)):
            return Reply(ok=False, error=f"safe refused: pid {request.pid} is not the sender's")
        ids = request.notice_ids or [n.id for n in self.store.pending()]
        if key not in self.clients and any(self.store.safe_count(i) >= MAX_CLIENTS for i in ids):
            return Reply(ok=False, error=f"safe refused: pid {request.pid} is not registered and "
                                         f"{MAX_CLIENTS} pids already reported safe")
        client = self.clients.get(key)
        if client is not None and client.proven and client.rank == 0:  # before a cancel ends them
            kinds = {n.kind for n in self.store.pending() if n.id in ids}
            if kinds:  # a restart after a drill is no interruption (the learned MTBF, .job_rates)
                self.ledger.stopped(client.job_id or DEFAULT_JOB, drill=kinds == {Kind.DRILL})
        unknown = self.store.mark_safe_all(ids, key)
        if current_peer.get().uid is not None:  # an unproven peer proves no hold on any notice
            self.timeline.safe([i for i in ids if i not in unknown], key, request,
                               (client.job_id if client is not None else "") or DEFAULT_JOB)
        self._on_change()
        return Reply(ok=True, data={"unknown": unknown})

    def _ack(self, request: AckRequest) -> Reply:
        """A client set its stop flag for these notices: the timeline's ``flagged`` stage."""
        key = key_of(request.pid, current_peer.get())
        if not may_act_for(current_peer.get(), request.pid, self.clients.get(key)):
            return Reply(ok=False, error=f"ack refused: pid {request.pid} is not the sender's")
        if current_peer.get().uid is not None:  # as in _safe: proven peers only
            self.timeline.ack(request.notice_ids, key, request.at)
        return Reply(ok=True)

    def _commit(self, request: CommitRequest) -> Reply:
        if self._root is None:
            exc = ValueError("the daemon has no checkpoint_root; restart it with --checkpoint-root DIR "
                             "(or SPOTGUARD_CHECKPOINT_ROOT=DIR) above your checkpoints")
            self._refused("commit", exc)
            return Reply(ok=False, error=f"commit refused: {exc}")
        try:
            path = checkpoint_dir(request.path, self._root, request.step)
            self._check_order(request.job_id or DEFAULT_JOB, request.step)
        except ValueError as exc:
            self._refused("commit", exc)
            return Reply(ok=False, error=f"commit refused: {exc}")
        self.on_commit(request, path)
        if current_peer.get().uid is not None:  # goodput from proven peers only (module docstring)
            self.ledger.committed(request.job_id or DEFAULT_JOB, request.step, request.reached_at)
            self.metrics.save_reported(request.save_seconds)
        return Reply(ok=True, data={"path": str(path)})

    def _progress(self, request: ProgressRequest) -> Reply:
        peer = current_peer.get()
        key = key_of(request.pid, peer)
        client = self.clients.get(key)
        if peer.uid is None:
            exc = PermissionError("the sender is unproven (tcp://): goodput is counted only from ipc:// "
                                  "peers, whose credentials the kernel reports")
            self._refused("progress", exc)
            return Reply(ok=False, error=f"progress refused: {exc}")
        if not may_act_for(peer, request.pid, client):
            return Reply(ok=False, error=f"progress refused: pid {request.pid} is not the sender's")
        try:
            trained = self.ledger.progress(request.job_id or DEFAULT_JOB, request.step, request.at, key,
                                           not_before=None if client is None else client.registered,
                                           nodes=request.nodes)
        except ValueError as exc:
            self._refused("progress", exc)
            return Reply(ok=False, error=f"progress refused: {exc}")
        self.metrics.training.inc(trained)
        return self._cadence(request)

    def _mtbf(self) -> dict[str, Any]:
        """The node MTBF a new job's cadence starts from, and where it comes from (register, status)."""
        return {"node_prior_s": self.rates.node_prior_s, "source": self.rates.node_prior_source}

    def _cadence(self, request: CadenceRequest | ProgressRequest) -> Reply:
        """The job's learned :class:`~spotguard.protocol.JobRate` (None: the ledger knows nothing of it)."""
        job = request.job_id or DEFAULT_JOB
        rate = self.rates.rate(job)
        return Reply(ok=True, data={"rate": None if rate is None else rate.model_dump(),
                                    "durable_s": self.time_to_durable(job)})

    def _check_order(self, job: str, step: int) -> None:
        """Record ``step`` as the job's newest; ValueError when an accepted step is newer."""
        known = self._known_step(job)
        newest = max(self._newest.get(job, -1), -1 if known is None else known)
        if step < newest:
            raise ValueError(f"step {step} is older than step {newest} already accepted for job "
                             f"{job!r} (a new run needs a new job_id)")
        if job not in self._newest and len(self._newest) >= MAX_JOBS:
            self._newest.pop(next(iter(self._newest)))
        self._newest[job] = step

    def _refused(self, what: str, exc: Exception) -> None:
        """Log a refusal loudly once per cause (numbers aside), at debug after that: a flood of
        bad requests must not flood the log."""
        cause = re.sub(r"\d+", "N", f"{what}: {exc}")[:160]
        if cause in self._causes or len(self._causes) >= 1000:
            log.debug("%s refused: %s", what, exc)
            return
        self._causes.add(cause)
        log.warning("%s refused: %s (further refusals for this cause are logged at debug)", what, exc)

    def _notify(self, request: NotifyRequest) -> Reply:
        if sum(n.source == manual.SOURCE for n in self.store.pending()) >= MAX_MANUAL:
            return Reply(ok=False, error=f"notify refused: {MAX_MANUAL} manual notices are pending")
        notice = manual_notice(request, platform=self.platform)
        self.store.add(notice)
        return Reply(ok=True, data={"notice": notice.model_dump(mode="json")})

    def _withdraw(self, request: WithdrawRequest) -> Reply:
        """Cancel the named pending notices (or all): ``cancelled by operator`` in their timelines."""
        if not may_operate(current_peer.get()):
            return Reply(ok=False, error="cancel refused: only the daemon's own user and root may cancel "
                                         "notices (over its ipc:// socket)")
        ids = [n.id for n in self.store.pending()] if request.all else request.ids
        unknown = [i for i in ids if not self.store.cancel(i, BY_OPERATOR)]
        return Reply(ok=True, data={"cancelled": [i for i in ids if i not in unknown], "unknown": unknown})

    def _notices(self) -> list[dict[str, Any]]:
        return [n.model_dump(mode="json") for n in self.store.offered()]
