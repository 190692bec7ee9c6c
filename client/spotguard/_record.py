"""What the library records about a run, for tools that judge it from outside.

``spotguard drill``, ``spotguard run`` and the daemon's goodput figures must not depend on what a
training script chooses to print. So when ``$SPOTGUARD_RECORD`` names a file, every process of the
job appends one JSON object per line to it, one line per event, opened with ``O_APPEND`` for each
write: lines of several processes (ranks, relaunches) never interleave, and a process killed at any
instant leaves every earlier line whole. Without the variable nothing is written, and nothing here
ever raises into the training loop: a record that cannot be written is logged once at debug level.

Every line carries ``v`` (the format, :data:`VERSION`), ``event``, ``t`` (Unix time), ``pid``,
``rank`` and ``job``. The events and their own fields:

* ``start``: ``root``, ``world_size``, ``argv``, ``cwd``, ``host``, ``restart_count`` (Slurm's
  ``SLURM_RESTART_COUNT`` or torchrun's ``TORCHELASTIC_RESTART_COUNT``, else None), ``resumed_from``
  (the step loaded, None for a fresh start), ``skipped`` (checkpoints passed over as corrupt:
  ``[{"path", "reason"}]``), ``total`` (the step budget), ``entries`` (the names of the state's
  entries, so a tool can say what a checkpoint leaves out).
* ``progress``: ``step``, the steps completed; rank 0, at most every :data:`PROGRESS_SECONDS`.
* ``commit``: ``step``, ``kind`` (``periodic``, ``requested``, ``emergency`` or ``final``),
  ``digest`` (:attr:`~spotguard.checkpoint.CommitInfo.digest`), ``blocking_s``, ``persist_s``,
  ``bytes``, ``path``; rank 0, once the checkpoint is committed.
* ``stop``: ``step``, ``saved`` (an emergency save was taken), ``seconds_left``, ``notice`` (its
  ``id`` and ``kind``); every rank, before it exits 75.
* ``finish``: ``step`` and ``digest`` of the final training state; rank 0, at the normal end.
* ``peer_lost``: ``step``, ``error``; a rank that exits 77 (``EXIT_PEER_LOST``) because a peer is
  gone, whether the agreement timed out or the progress watchdog found no step boundary for
  ``Run(peer_timeout=)`` seconds.
* ``forced_exit``: ``reason``; a process whose clean stop hung, just before the watchdog's exit 76
  (``EXIT_FORCED``), written from the watchdog's thread.
* ``load_failed``: ``error``; every rank whose load of the latest checkpoint raised (the process
  then exits with that error). Corrupt checkpoints passed over are ``start``'s ``skipped``.

Two runs of the same job that end with equal ``finish`` digests ended in bit-identical states: the
digest covers every byte of every entry of the checkpoint (model, optimizer, scheduler, data
position, RNG states), and nothing else (no times, no paths).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["ENV", "VERSION", "PROGRESS_SECONDS", "Recorder", "read", "read_new", "restart_count"]

log = logging.getLogger(__name__)

ENV = "SPOTGUARD_RECORD"
VERSION = 1
PROGRESS_SECONDS = 0.1
"""Rank 0 records progress at most ten times a second: fine enough to count the steps a kill lost."""


def restart_count() -> int | None:
    """How many times the scheduler or launcher restarted this job, when it says so."""
    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


class Recorder:
    """Appends events to ``path`` (default ``$SPOTGUARD_RECORD``); does nothing without one."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, rank: int = 0, job: str = "") -> None:
        path = path if path is not None else os.environ.get(ENV) or None
        self.path = Path(path) if path else None
        self.rank, self.job = rank, job
        self._next_progress = 0.0
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def start(self, *, root: str | os.PathLike[str], world_size: int, resumed_from: int | None,
              skipped: list[dict[str, str]], total: int | None, entries: list[str] | None = None) -> None:
        self.emit("start", root=str(root), world_size=world_size, argv=list(sys.argv),
                  cwd=os.getcwd(), host=socket.gethostname(), restart_count=restart_count(),
                  resumed_from=resumed_from, skipped=skipped, total=total, entries=entries)

    def progress(self, step: int) -> None:
        """Record ``step`` unless one was recorded less than PROGRESS_SECONDS ago (rank 0 only)."""
        if self.path is None or self.rank != 0:
            return
        now = time.monotonic()
        if now >= self._next_progress:
            self._next_progress = now + PROGRESS_SECONDS
            self.emit("progress", step=step)

    def emit(self, event: str, **fields: Any) -> None:
        """Append one event line; never raises."""
        if self.path is None:
            return
        line = {"v": VERSION, "event": event, "t": time.time(), "pid": os.getpid(), "rank": self.rank,
                "job": self.job, **fields}
        data = (json.dumps(line, separators=(",", ":"), default=str) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.debug("cannot append to the run record %s: %s", self.path, exc)


def read(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The events of a record file in order; lines that are not events of this format are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    yield from _events(text.splitlines())


def read_new(path: str | os.PathLike[str], offset: int) -> tuple[list[dict[str, Any]], int]:
    """The events appended since byte ``offset`` and the offset to pass next time, for a reader
    that follows a live record: a last line not yet ended by a newline is left for the next call."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            data = file.read()
    except FileNotFoundError:
        return [], offset
    whole = data[: data.rfind(b"\n") + 1]
    lines = whole.decode("utf-8", errors="replace").splitlines()
    return list(_events(lines)), offset + len(whole)


def _events(lines: list[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("v") == VERSION and isinstance(event.get("event"), str):
            yield event
