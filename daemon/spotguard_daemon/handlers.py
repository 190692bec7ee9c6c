"""Answers to the protocol's requests: the client registry, safe reports, commits, manual notices.

The server validates every request before it gets here; these methods only decide. They are quick
and do no network I/O (the server answers one request at a time).

Clients are known by pid. A pid is only a name: it may belong to another PID namespace (a sidecar
container) or be reused after the client died. So each registration records the process's start
time from ``/proc/<pid>/stat`` when the pid is visible; a client counts as alive (and may be
signalled) only while the same process still runs, and a client whose pid was not visible is
kept until it unregisters and is never signalled.

Commits: ``path`` is joined to ``checkpoint_root`` when relative, resolved with ``realpath`` (``..``
and symlinks followed) and refused unless the result lies inside the resolved root and exists. An
accepted commit is passed to ``on_commit(request, resolved_path)``; the storage engine should still
open the files with care (the tree may change after the check).

Exceptions: none; every refusal is an error :class:`~spotguard.protocol.Reply`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from spotguard.protocol import (
    CommitRequest, NotifyRequest, RegisterRequest, Reply, Request, SafeRequest, UnregisterRequest,
    utcnow,
)

from spotguard_daemon.store import NoticeStore
from spotguard_daemon.watchers.manual import manual_notice

__all__ = ["Client", "RequestHandler", "confine", "process_start_time"]

log = logging.getLogger(__name__)

CommitHook = Callable[[CommitRequest, Path], None]


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when the pid is not visible."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def confine(path: str, root: Path) -> Path:
    """Resolve ``path`` (relative ones against ``root``) and return it if it lies inside ``root``.

    Raises ``ValueError`` naming the problem otherwise.
    """
    real_root = Path(os.path.realpath(root))
    resolved = Path(os.path.realpath(root / path))
    if not resolved.is_relative_to(real_root):
        raise ValueError(f"path {path!r} resolves outside the checkpoint root {str(real_root)!r}")
    if not resolved.exists():
        raise ValueError(f"path {path!r} does not exist")
    return resolved


@dataclass
class Client:
    pid: int
    rank: int = 0
    job_id: str = ""
    registered_at: str = field(default_factory=lambda: utcnow().isoformat())
    start_time: int | None = None

    def alive(self) -> bool:
        """True unless the process is known to be gone (or its pid reused)."""
        return self.start_time is None or process_start_time(self.pid) == self.start_time

    def signallable(self) -> bool:
        return self.start_time is not None and self.alive()


class RequestHandler:
    """Turns each validated request into a :class:`Reply`; ``info()`` feeds ``status``."""

    def __init__(self, store: NoticeStore, *, platform: str, checkpoint_root: Path | None,
                 info: Callable[[], dict[str, Any]], on_commit: CommitHook | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.store = store
        self.clients: dict[int, Client] = {}
        self.on_commit = on_commit or (lambda request, path: None)
        self.platform = platform
        self._root = checkpoint_root
        self._refusals: set[str] = set()
        self._info = info
        self._on_change = on_change or (lambda: None)

    async def __call__(self, request: Request) -> Reply:
        method = getattr(self, f"_{request.type}")
        return method(request)

    def live_clients(self) -> list[Client]:
        """Registered clients, after dropping those whose process is gone."""
        for pid in [p for p, c in self.clients.items() if not c.alive()]:
            log.info("client pid %d is gone; unregistering it", pid)
            del self.clients[pid]
            self._on_change()
        return list(self.clients.values())

    def signallable_pids(self) -> list[int]:
        return [c.pid for c in self.live_clients() if c.signallable()]

    # ------------------------------------------------------------------ requests

    def _register(self, request: RegisterRequest) -> Reply:
        self.clients[request.pid] = Client(request.pid, request.rank, request.job_id,
                                           start_time=process_start_time(request.pid))
        log.info("client pid %d registered (rank %d, job %r)", request.pid, request.rank, request.job_id)
        self._on_change()
        return Reply(ok=True, data={"notices": self._notices()})

    def _unregister(self, request: UnregisterRequest) -> Reply:
        known = self.clients.pop(request.pid, None) is not None
        self._on_change()
        return Reply(ok=True, data={"known": known})

    def _status(self, _request: Request) -> Reply:
        clients = [vars(c).copy() for c in self.live_clients()]
        for client in clients:
            client.pop("start_time")
        safe = {n.id: sorted(self.store.safe_pids(n.id)) for n in self.store.pending()}
        return Reply(ok=True, data={**self._info(), "notices": self._notices(), "safe": safe,
                                    "clients": clients})

    def _safe(self, request: SafeRequest) -> Reply:
        ids = request.notice_ids or [n.id for n in self.store.pending()]
        unknown = [i for i in ids if not self.store.mark_safe(i, request.pid)]
        self._on_change()
        return Reply(ok=True, data={"unknown": unknown})

    def _commit(self, request: CommitRequest) -> Reply:
        if self._root is None:
            return self._refused("the daemon has no checkpoint_root; restart it with --checkpoint-root "
                                 "DIR (or SPOTGUARD_CHECKPOINT_ROOT=DIR) above your checkpoints")
        try:
            path = confine(request.path, self._root)
        except ValueError as exc:
            return self._refused(f"{exc}; the daemon's --checkpoint-root must be a directory above it")
        self.on_commit(request, path)
        return Reply(ok=True, data={"path": str(path)})

    def _refused(self, cause: str) -> Reply:
        """An error reply; the first refusal of each cause is a WARNING in the daemon log too."""
        if cause not in self._refusals and len(self._refusals) < 100:
            self._refusals.add(cause)
            log.warning("commit refused: %s", cause)
        return Reply(ok=False, error=f"commit refused: {cause}")

    def _notify(self, request: NotifyRequest) -> Reply:
        notice = manual_notice(request, platform=self.platform)
        self.store.add(notice)
        return Reply(ok=True, data={"notice": notice.model_dump(mode="json")})

    def _notices(self) -> list[dict[str, Any]]:
        return [n.model_dump(mode="json") for n in self.store.pending()]
