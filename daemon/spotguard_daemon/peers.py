"""Registered client processes, and who may register, signal or speak for a pid.

A pid is only a name: it may belong to another PID namespace (a sidecar container), be reused after
the client died, or belong to someone else entirely. So a registration records

* the process's start time from ``/proc/<pid>/stat``: a client counts as alive (and may be
  signalled) only while the same process still runs;
* the uid that owns it, which must be the uid of the peer that registered it (``SO_PEERCRED`` on
  ``ipc://``, see :class:`~spotguard_daemon.server.Peer`). A peer may name only its own processes
  (real and effective uid both its own); root may name any. The daemon runs with ``CAP_KILL`` under
  the shipped systemd unit, so without this rule any client could have it signal any process.

A client whose pid is not visible (another PID namespace), or that registered over ``tcp://``
(which cannot prove who the peer is), is kept until it unregisters or goes away and is **never
signalled**: it learns of notices over the PUB socket only.

Exceptions: none; :func:`owner_uid` and :func:`process_start_time` return None for a pid they
cannot see.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from spotguard.protocol import utcnow

from spotguard_daemon.server import Peer

__all__ = ["Client", "may_act_for", "owner_uid", "process_start_time"]

log = logging.getLogger(__name__)


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when the pid is not visible."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def owner_uid(pid: int) -> int | None:
    """The uid that fully owns the process (real and effective uid equal), else None.

    None also when the pid is not visible. A setuid program run by a user (real uid the user's,
    effective uid root's) is owned by no one here, so nobody but root can register it.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                real, effective = (int(v) for v in line.split()[1:3])
                return real if real == effective else None
    except (OSError, ValueError):
        return None
    return None


@dataclass
class Client:
    pid: int
    rank: int = 0
    job_id: str = ""
    registered_at: str = field(default_factory=lambda: utcnow().isoformat())
    start_time: int | None = None
    uid: int | None = None
    """The owner's uid, proven by the peer's credentials; None: unproven, never signalled."""

    @classmethod
    def register(cls, pid: int, rank: int, job_id: str, peer: Peer) -> "Client":
        """A client for ``pid`` as ``peer`` may register it; raises ``PermissionError`` otherwise."""
        start, uid = process_start_time(pid), owner_uid(pid)
        if peer.uid is None or start is None:
            return cls(pid, rank, job_id)  # tcp:// or another PID namespace: never signalled
        if peer.uid != 0 and uid != peer.uid:
            raise PermissionError(f"pid {pid} is not a process of uid {peer.uid} (the sender); "
                                  "a client may register only its own processes")
        return cls(pid, rank, job_id, start_time=start, uid=uid)

    def alive(self) -> bool:
        """True unless the process is known to be gone (or its pid reused)."""
        return self.start_time is None or process_start_time(self.pid) == self.start_time

    def signallable(self) -> bool:
        """Proven owner, same process as registered, and still owned by that uid."""
        return (self.start_time is not None and self.uid is not None and self.alive()
                and owner_uid(self.pid) == self.uid)

    def public(self) -> dict:
        return {"pid": self.pid, "rank": self.rank, "job_id": self.job_id,
                "registered_at": self.registered_at, "signal": self.start_time is not None
                and self.uid is not None}


def may_act_for(peer: Peer, pid: int, client: Client | None) -> bool:
    """Whether ``peer`` may unregister ``pid`` or report it safe.

    Root may act for anyone; a client with a proven owner only a peer of that uid; any other pid
    a ``tcp://`` peer (unproven, like the clients it may act for) or a peer that owns it (or
    cannot see it).
    """
    if peer.uid == 0:
        return True
    if client is not None and client.uid is not None:
        return client.uid == peer.uid
    return peer.uid is None or owner_uid(pid) in (None, peer.uid)
