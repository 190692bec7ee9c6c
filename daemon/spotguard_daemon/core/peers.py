"""Registered client processes, and who may register, signal or speak for a pid.

A pid is only a name: it may belong to another PID namespace (a sidecar container), be reused after
the client died, or belong to someone else entirely. So a registration records

* the process's start time from ``/proc/<pid>/stat``: a client counts as alive (and may be
  signalled) only while the same process still runs;
* the uid that owns it, which must be the uid of the peer that registered it (``SO_PEERCRED`` on
  ``ipc://``, see :class:`~spotguard_daemon.core.server.Peer`). A peer may name only its own processes
  (real and effective uid both its own), and of those only itself and its descendants (``spotguard
  run`` registers the job it started); root in the daemon's PID namespace may name any. The daemon
  runs with ``CAP_KILL`` under the shipped systemd unit, so without this rule any client could have
  it signal any process.

A client in a container (a child PID namespace) names processes by their pids in its namespace:
itself, known by the pid the kernel reports for the peer, or one of its descendants, found below
the peer by its ``NSpid``. Any other pid it names is refused, root's too: the number would name an
unrelated process of the daemon's namespace. A pid that is not a running process is refused. A
client that registered over ``tcp://`` (which cannot prove who the peer is), or from an unrelated
PID namespace, is unproven: kept until it unregisters or is evicted by newer unproven ones, and
**never signalled**; it learns of notices over the PUB socket only. Neither is a client that said
it does not handle the signal (``RegisterRequest.signal``: a Guard made outside the main thread has
no handler, and SIGUSR1's default action would kill it); ``spotguard run`` registering that process
again for its job keeps what it said.

A registration is keyed by what the kernel proves (:func:`key_of`): the process's pid in the
daemon's namespace (its start time checked on every use), never by the pid the client named, which
containers share (every container's first process is its pid 1). Two containers of one uid that each
register their pid 1 hold two registrations, and both are signalled. Only an unproven registration
is keyed by the pid it names.

Exceptions: none; :func:`owner_uid` and :func:`process_start_time` return None for a pid they
cannot see.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from spotguard.protocol import utcnow

from spotguard_daemon.core.server import Peer
from spotguard_daemon.proctree import descendants, descends, owner_uid, process_start_time

__all__ = ["Client", "key_of", "may_act_for", "may_operate"]

log = logging.getLogger(__name__)


@dataclass
class Client:
    pid: int
    rank: int = 0
    job_id: str = ""
    registered_at: str = field(default_factory=lambda: utcnow().isoformat())
    start_time: int | None = None
    uid: int | None = None
    """The owner's uid, proven by the peer's credentials; None: unproven, never signalled."""
    target: int | None = None
    """The process as this daemon sees it: ``pid``, or the peer's pid when a client in a child
    PID namespace (a container) registered itself under its own pid."""
    resumed: str | None = None
    """The job this registration was counted as a restart of (:mod:`.handlers`): never twice."""
    handles_signal: bool = True
    """The process said it handles the delivery signal; False (a Guard outside the main thread, no
    handler installed, where SIGUSR1's default action would kill it): never signalled."""

    @classmethod
    def register(cls, pid: int, rank: int, job_id: str, peer: Peer, handles_signal: bool = True) -> "Client":
        """A client for ``pid`` as ``peer`` may register it; raises ``PermissionError`` otherwise."""
        if peer.uid is None or not peer.pid:
            return cls(pid, rank, job_id, handles_signal=handles_signal)  # tcp://, or an unrelated PID namespace
        target = _target(pid, peer.pid)
        start = None if target is None else process_start_time(target)
        if start is None:
            raise PermissionError(f"pid {pid} is not a running process this daemon can see"
                                  + ("" if target else " below the sender (a client in a container "
                                     "may register only itself and its descendants)"))
        uid = owner_uid(target)
        if peer.uid != 0 and uid != peer.uid:
            raise PermissionError(f"pid {pid} is not a process of uid {peer.uid} (the sender); "
                                  "a client may register only its own processes")
        if peer.uid != 0 and target != peer.pid and not descends(target, peer.pid):
            raise PermissionError(f"pid {pid} is neither the sender nor one of its descendants; "
                                  "a client may register only those")
        return cls(pid, rank, job_id, start_time=start, uid=uid, target=target, handles_signal=handles_signal)

    @property
    def key(self) -> int:
        """Its key among the registrations: the daemon's pid of the process once proven (see the
        module docstring), else the pid it named."""
        return self.target if self.proven and self.target is not None else self.pid

    @property
    def registered(self) -> float:
        """When it registered (Unix seconds)."""
        return datetime.fromisoformat(self.registered_at).timestamp()

    @property
    def proven(self) -> bool:
        return self.start_time is not None and self.uid is not None

    def alive(self) -> bool:
        """True unless the process is known to be gone (or its pid reused)."""
        return self.target is None or process_start_time(self.target) == self.start_time

    def signallable(self) -> bool:
        """Handles the signal, proven owner, same process as registered, and still owned by that uid."""
        return self.handles_signal and self.proven and self.alive() and owner_uid(self.target) == self.uid

    def public(self) -> dict:
        """As ``status`` shows it; ``signal`` is what a notice would do now (:meth:`signallable`:
        a process that has since run a setuid program, or changed owner, is not signalled)."""
        return {"pid": self.pid, "rank": self.rank, "job_id": self.job_id,
                "registered_at": self.registered_at, "signal": self.signallable()}


def key_of(pid: int, peer: Peer) -> int:
    """The key of the registration ``peer`` names ``pid`` (:attr:`Client.key`): the daemon's pid
    of that process when the peer's credentials tell which one it is, else ``pid`` itself."""
    if peer.uid is None or not peer.pid:
        return pid
    target = _target(pid, peer.pid)
    return pid if target is None else target


def _target(pid: int, peer_pid: int) -> int | None:
    """The daemon's pid of the process the peer names ``pid``: the peer itself, a descendant named
    by its pid in the peer's namespace, or (a peer in the daemon's namespace) ``pid`` as it is;
    None when a peer in another namespace names none of those."""
    own = _own_view_pid(peer_pid)
    if pid in (peer_pid, own):
        return peer_pid
    if own in (None, peer_pid):
        return pid
    return next((child for child in descendants(peer_pid) if _own_view_pid(child) == pid), None)


def _own_view_pid(pid: int) -> int | None:
    """The pid a process has in its own PID namespace (the last ``NSpid`` entry), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def may_act_for(peer: Peer, pid: int, client: Client | None) -> bool:
    """Whether ``peer`` may unregister ``pid`` or report it safe.

    Root may act for anyone; a client with a proven owner only a peer of that uid; any other pid
    a ``tcp://`` peer (unproven, like the clients it may act for) or a peer that owns it (or
    cannot see it).
    """
    if peer.uid == 0:
        return True
    if client is not None and client.proven:
        return client.uid == peer.uid
    return peer.uid is None or owner_uid(pid) in (None, peer.uid)


def may_operate(peer: Peer) -> bool:
    """Whether ``peer`` may act on the daemon itself (withdraw notices): the daemon's own user or
    root, proven by the kernel (``ipc://``); never a ``tcp://`` peer."""
    return peer.uid is not None and peer.uid in (0, os.geteuid())
