"""The proposed step of a job with node-local roots, held open from its commit until it is uploaded.

When node 0 proposes a step ahead of the commits (:meth:`.Fleet.threshold`), each daemon knows
the step before the job commits it. Its upload may start only several saves later (the upload
in flight first notices the newer commit between two objects), and the job's retention (``keep``)
may delete the step before that. So the daemon opens the checkpoint's files as the commit is
reported (:func:`.confine.staged`, the same confined view an upload reads) and keeps them open
until this node's part of the step is in the store, the step is global, or another step is
pinned. At most one step per job is pinned; while the job's retention has deleted it, its files
take their disk space until the upload ends. Thread-safe (commits are reported on the server's
thread, uploads run on the worker's).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

from spotguard.storage._local import ManifestError

from spotguard_daemon.core import confine

__all__ = ["Pins"]

log = logging.getLogger(__name__)


class Pins:
    """Per job: the pinned step, its checkpoint's path, and the open view of it."""

    def __init__(self, root: Path | None, staging: Path) -> None:
        self.root, self.staging = root, staging
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, str, Path, contextlib.ExitStack]] = {}

    def pin(self, job: str, path: Path, step: int) -> None:
        """Open the committed checkpoint ``path`` of ``step`` and hold it (a failure: not pinned,
        the upload opens it later as usual, said at INFO)."""
        stack = contextlib.ExitStack()
        try:
            view = stack.enter_context(confine.staged(self.root or Path(path).parent, Path(path), step,
                                                      self.staging))
        except (OSError, confine.UnsafeCheckpoint, ManifestError) as exc:
            stack.close()
            log.info("could not hold %s step %d open for its upload: %s", job, step, exc)
            return
        with self._lock:
            old = self._held.pop(job, None)
            self._held[job] = (step, str(path), view, stack)
        if old is not None:
            old[3].close()

    def get(self, job: str) -> tuple[int, str] | None:
        """The pinned step of ``job`` and its path (None: none)."""
        with self._lock:
            held = self._held.get(job)
        return None if held is None else (held[0], held[1])

    def view(self, job: str, step: int) -> Path | None:
        """The open view of ``step`` when it is the pinned one."""
        with self._lock:
            held = self._held.get(job)
        return held[2] if held is not None and held[0] == step else None

    def release(self, job: str, upto: int) -> None:
        """Close the pinned step of ``job`` if it is ``upto`` or older (uploaded, global, refused)."""
        with self._lock:
            held = self._held.get(job)
            if held is None or held[0] > upto:
                return
            del self._held[job]
        held[3].close()

    def close(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for _, _, _, stack in held:
            stack.close()
