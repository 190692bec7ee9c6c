"""The peer tier's two halves in one daemon, built from ``peer.*``: the server that holds the
partners' parts (:mod:`.peer_server`) and the thread that copies this node's parts to them
(:mod:`.replicate`). Off unless ``peer.listen`` or ``peer.partners`` is set."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotguard_daemon.core.peer_server import PeerServer
from spotguard_daemon.core.replicate import Replicator

__all__ = ["PeerTier"]

log = logging.getLogger(__name__)


class PeerTier:
    def __init__(self, settings: Any, jobs: Callable[[], set[str]]) -> None:
        peer = settings.peer
        secret = peer.secret.get_secret_value() if peer.secret is not None else ""
        self.server: PeerServer | None = None
        self.replicator: Replicator | None = None
        if peer.listen:
            host, _, port = peer.listen.rpartition(":")
            self.server = PeerServer(settings.state_dir / "peer", secret, keep=peer.keep, timeout=peer.timeout,
                                     jobs=jobs, nice=settings.storage.upload_nice)
            try:
                self.server.start(host.strip("[]"), int(port))
            except OSError as exc:
                raise OSError(exc.errno, f"cannot serve partners on peer.listen {peer.listen}: "
                                         f"{exc.strerror or exc}") from None
        if peer.partners:
            if settings.checkpoint_root is None:
                log.warning("peer.partners is set but the daemon has no checkpoint_root: nothing is copied")
            else:
                self.replicator = Replicator(Path(settings.checkpoint_root), list(peer.partners), secret,
                                             timeout=peer.timeout, staging=settings.runtime_dir / "peer-staging",
                                             nice=settings.storage.upload_nice)

    def submit(self, job: str, path: Path, step: int, then: Callable[[], None] | None = None) -> bool:
        """Copy the commit to the partners, then run ``then``; False (``then`` not run) when this
        daemon copies nothing."""
        if self.replicator is None:
            return False
        self.replicator.submit(job, path, step, then)
        return True

    def idle(self) -> bool:
        return self.replicator is None or self.replicator.idle()

    def time_to_copy(self, job: str) -> float | None:
        return self.replicator.time_to_copy(job) if self.replicator is not None else None

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.server is not None and self.server.address is not None:
            out["listen"] = "%s:%d" % self.server.address
        if self.replicator is not None:
            out.update(self.replicator.status())
        return out

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.close(timeout=1.0)
        if self.server is not None:
            self.server.close()
