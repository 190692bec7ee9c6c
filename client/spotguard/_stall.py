"""A rank hung on its own, told from a lost peer: the probe of :class:`spotguard.run.Run`'s progress watchdog.

With more than one rank, a rank that reaches no step boundary for ``peer_timeout`` + 10 s is ended
as having lost a peer (77). When the hang is this rank's own and visible from here, that is the
wrong diagnosis and a needless wait: the rank ends early, with ``EXIT_FORCED`` (76) and a message
naming the cause, and its peers then see it gone. Two local hangs are visible:

* **the loader**: the loop has waited for one batch of its :class:`spotguard.DataLoader` for the
  loader's ``stall_timeout`` while its workers are alive (a worker blocked in ``__getitem__``, or
  forked into a deadlock); with ``num_workers=0`` the dataset itself has not returned;
* **the save**: the loop has waited that long for this rank's own checkpoint save, and the save is
  not waiting for the other ranks (its exchange would be theirs to answer): a write or an fsync that
  does not return.

The limit is ``stall_timeout`` when the loader has one, else ``min(300 s, peer_timeout / 2)``: well
before the peer watchdog, long enough for a first batch that starts workers. When the peer watchdog
fires first (a limit above ``peer_timeout``), a loop that was waiting for its loader or its save for
at least half of ``peer_timeout`` is still named as the cause.

The probe runs in the watchdog's thread while the main thread may hold any lock: it only reads
attributes and ``/proc``.
"""

from __future__ import annotations

from typing import Any

from spotguard.exit_codes import EXIT_FORCED

__all__ = ["LocalHangs", "DEFAULT_STALL_SECONDS"]

DEFAULT_STALL_SECONDS = 300.0
"""The longest a local wait may last before the rank is ended as hung, unless ``peer_timeout / 2``
or the loader's ``stall_timeout`` says otherwise."""


class LocalHangs:
    """The probe (see :class:`spotguard._watchdog.Watchdog`) over a run's loader and checkpointer."""

    def __init__(self, run: Any, peer_timeout: float, rank: int) -> None:
        self._run, self._peer_timeout, self._rank = run, peer_timeout, rank

    def limit(self, loader: Any = None) -> float:
        """Seconds of one local wait after which the rank is ended as hung."""
        given = getattr(loader, "stall_timeout", None)
        return given if given else min(DEFAULT_STALL_SECONDS, self._peer_timeout / 2)

    def probe(self, final: bool) -> tuple[int, str] | None:
        reason = self._loader(final) or self._save(final)
        return None if reason is None else (EXIT_FORCED, reason)

    def _over(self, waited: float, limit: float, final: bool) -> bool:
        return waited >= limit or (final and waited >= self._peer_timeout / 2)

    def _loader(self, final: bool) -> str | None:
        loader = self._run.state.get("loader")
        waiting = getattr(loader, "waiting_seconds", None)
        waited = waiting() if callable(waiting) else None
        limit = self.limit(loader)
        if waited is None or not self._over(waited, limit, final):
            return None
        if loader.num_workers:
            pids = [pid for pid in loader.worker_pids() if _alive(pid)]
            if not pids:
                return None  # a worker that died: torch raises in the loop itself
            what = (f"its {len(pids)} DataLoader worker(s) (pid {', '.join(map(str, pids))}) are alive "
                    "but produced no batch")
        else:
            what = "the dataset, read in the main process (num_workers=0), has not returned"
        return (f"rank {self._rank}: no batch for {waited:.0f} s: {what}; this rank is hung on its own "
                f"data loading, not waiting for a peer (limit {limit:.0f} s, "
                "spotguard.DataLoader(stall_timeout=))")

    def _save(self, final: bool) -> str | None:
        waiting = self._run.checkpointer.waiting()
        limit = self.limit()
        if waiting is None or waiting[1] or not self._over(waiting[0], limit, final):
            return None
        return (f"rank {self._rank}: waited {waiting[0]:.0f} s for its own checkpoint save, which is not "
                "waiting for any peer: this rank's save is hung (its file system?), not a peer "
                f"(limit {limit:.0f} s)")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
