"""Copies each committed node-local part to the partner nodes' peer servers (the peer tier).

A commit of a node-local checkpoint (a manifest with a ``node`` table: the ranks this node holds)
is queued here as well as for the bucket. One thread sends it, read through
:func:`.confine.staged` like an upload, to every ``peer.partners`` URL with
:meth:`spotguard.storage.peer.PeerClient.push`. Per job only the newest commit waits: a newer one
replaces it, since the partner keeps only the newest ``keep`` anyway. The peer copy runs before and
beside the bucket upload, not after it: it is what a node lost without notice costs, seconds where
the bucket costs an upload. A failed push is retried ``ATTEMPTS`` times, a second apart, unless a
newer commit of the job arrived; then it is logged (once per partner and cause) and dropped.

``then``: what to run once a commit's copy is over, copied or not (superseded, failed, or left
pending at :meth:`Replicator.close`). The daemon passes the commit's bucket upload when a notice
leaves less time than the upload takes: the partners get the part first, alone on the link.

Exceptions: none escape the thread; an error restarts nothing and is logged.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from spotguard._priority import lower_priority
from spotguard.storage._local import MANIFEST
from spotguard.storage.peer import PeerClient, PeerError, slot_of

from spotguard_daemon.core import confine

__all__ = ["ATTEMPTS", "Replicator"]

log = logging.getLogger(__name__)

ATTEMPTS = 3
TIMES_KEPT = 5


class Replicator:
    """One thread pushing committed parts to ``partners`` (URLs), newest per job first."""

    def __init__(self, root: Path, partners: list[str], secret: str, *, timeout: float, staging: Path,
                 nice: int | None = None) -> None:
        self.root, self.partners, self._secret = root, [p.rstrip("/") for p in partners], secret
        self._timeout, self._staging, self._nice = timeout, staging, nice
        self._pending: dict[str, tuple[Path, int, float, Callable[[], None] | None]] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._copying = False
        self._said: set[tuple[str, str]] = set()
        self.replicated: dict[str, dict[str, Any]] = {}
        """``{job: {"step", "seconds", "bytes", "partners"}}`` of each job's newest copied part."""
        self._times: dict[str, deque[float]] = {}
        """Per job, the last ``TIMES_KEPT`` commit-to-copied seconds (:meth:`time_to_copy`)."""
        self._thread = threading.Thread(target=self._run, name="spotguard-peer-push", daemon=True)
        self._thread.start()

    def submit(self, job: str, path: Path, step: int, then: Callable[[], None] | None = None) -> None:
        """Copy ``path`` (step ``step`` of ``job``) to the partners, replacing an older commit of the
        job still waiting (whose ``then`` runs now); one older than the waiting commit is not copied."""
        with self._cv:
            old = self._pending.get(job)
            if old is None or old[1] <= step:
                self._pending[job] = (path, step, time.monotonic(), then)
                self._cv.notify()
                dropped = old[3] if old is not None else None
            else:
                dropped = then
        _run_then(dropped)

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {"partners": list(self.partners), "pending": {j: p[1] for j, p in self._pending.items()},
                    "replicated": dict(self.replicated)}

    def idle(self) -> bool:
        """Nothing waits to be copied and nothing is being copied."""
        with self._cv:
            return not self._pending and not self._copying

    def time_to_copy(self, job: str) -> float | None:
        """Median seconds from a commit of ``job`` to its part held by every partner (the last
        ``TIMES_KEPT``), or None before one was copied."""
        with self._cv:
            times = list(self._times.get(job, ()))
        return statistics.median(times) if times else None

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)
        with self._cv:
            left, self._pending = list(self._pending.values()), {}
        for *_, then in left:
            _run_then(then)

    def _run(self) -> None:
        lower_priority(self._nice)
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job, (path, step, submitted, then) = self._pending.popitem()
                self._copying = True
            try:
                self._replicate(job, path, step, submitted)
            except (confine.UnsafeCheckpoint, OSError) as exc:  # e.g. retention deleted it first
                log.warning("peer: step %d of job %r not copied: %s", step, job, exc)
            except Exception:  # the thread must survive any one part
                log.exception("peer: copying step %d of job %r failed", step, job)
            _run_then(then)
            with self._cv:
                self._copying = False

    def _superseded(self, job: str, step: int) -> bool:
        with self._cv:
            return job in self._pending and self._pending[job][1] > step

    def _replicate(self, job: str, path: Path, step: int, submitted: float) -> None:
        started = time.monotonic()
        with confine.staged(self.root, path, step, self._staging) as part:
            node = json.loads((part / MANIFEST).read_bytes()).get("node")
            if not isinstance(node, dict) or not isinstance(node.get("ranks"), list):
                log.debug("peer: step %d of job %r is not node-local; nothing to copy", step, job)
                return
            slot = slot_of(node["ranks"])
            done, sent = [], 0
            for url in self.partners:
                for attempt in range(1, ATTEMPTS + 1):
                    if self._superseded(job, step):
                        log.info("peer: step %d of job %r superseded before %s took it", step, job, url)
                        return
                    try:
                        with PeerClient(url, self._secret, job, timeout=self._timeout) as client:
                            sent = client.push(slot, step, part)
                        done.append(url)
                        break
                    except (PeerError, OSError) as exc:
                        if attempt == ATTEMPTS:
                            self._say(url, exc, f"peer: could not copy step {step} of job {job!r} ({slot}) "
                                                f"to {url} after {ATTEMPTS} attempts: {exc}")
                        else:
                            time.sleep(1.0)
        seconds = time.monotonic() - started
        if done:
            rate = sent / seconds / 1e6 if seconds > 0 else 0.0
            log.info("peer: step %d of job %r (%s, %d bytes) copied to %s in %.2f s (%.0f MB/s)", step, job,
                     slot, sent, ", ".join(done), seconds, rate)
            with self._cv:
                self.replicated[job] = {"step": step, "seconds": round(seconds, 3), "bytes": sent, "partners": done}
                if len(done) == len(self.partners):
                    self._times.setdefault(job, deque(maxlen=TIMES_KEPT)).append(time.monotonic() - submitted)

    def _say(self, url: str, exc: Exception, message: str) -> None:
        cause = (url, type(exc).__name__ + str(exc)[:60])
        if cause not in self._said:
            self._said.add(cause)
            log.warning("%s", message)
        else:
            log.debug("%s", message)


def _run_then(then: Callable[[], None] | None) -> None:
    if then is None:
        return
    try:
        then()
    except Exception:  # e.g. the upload queue refused it: that is logged there; the copy stands
        log.exception("peer: what was to follow a copy failed")
