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
  entries, so a tool can say what a checkpoint leaves out), ``loaded_digest`` (the digest of the
  checkpoint loaded, as committed).
* ``progress``: ``step``, the steps completed; rank 0, at most every :data:`PROGRESS_SECONDS`.
* ``commit``: ``step``, ``kind`` (``periodic``, ``requested``, ``emergency`` or ``final``),
  ``digest`` (:attr:`~spotguard.checkpoint.CommitInfo.digest`), ``blocking_s``, ``persist_s``,
  ``bytes``, ``path``, ``mtbf_s`` and ``mtbf_source`` (the MTBF the cadence planned with: ``given``,
  ``learned`` or ``default``); rank 0, once the checkpoint is committed.
* ``stop``: ``step``, ``saved`` (an emergency save was taken), ``seconds_left``, ``notice`` (its
  ``id`` and ``kind``); every rank, before it exits 75. The client's side of the daemon's notice
  timeline too: ``save`` (``committed``, ``already``, ``no_room`` or ``failed``), ``estimate_s``
  (the save's expected seconds that decided it), and the Unix times ``flagged_t`` (the stop flag
  was set), ``stopped_t`` (the loop stopped), ``committed_t`` (the emergency save committed) and
  ``safe_t`` (the daemon took the safe report; None when none answered).
* ``finish``: ``step`` and ``digest`` of the final training state; rank 0, at the normal end.
* ``peer_lost``: ``step``, ``error``; a rank that exits 77 (``EXIT_PEER_LOST``) because a peer is
  gone, whether the agreement timed out or the progress watchdog found no step boundary for
  ``Run(peer_timeout=)`` seconds.
* ``forced_exit``: ``reason``; a process whose clean stop hung, just before the watchdog's exit 76
  (``EXIT_FORCED``), written from the watchdog's thread.
* ``load_failed``: ``error``; every rank whose load of the latest checkpoint raised (the process
  then exits with that error). Corrupt checkpoints passed over are ``start``'s ``skipped``.
* ``data``: ``step``, ``ids`` (a digest of the sample ids that step drew); ``marks``: ``step``,
  ``at`` (``save`` or ``load``), ``rng`` (a digest per RNG stream), ``lr``, ``epoch``, ``loss``
  (the progress state at each save and after a resume's load); ``unsaved``: ``what`` (an
  optimizer or LR scheduler the job uses but did not hand to ``Run``); ``ddp``: ``entry``,
  ``world_size`` (a model trained through a DDP that ``Run`` was not given); rank 0, see
  :mod:`spotguard._audit`. With ``SPOTGUARD_RECORD_ELASTIC=1`` (``spotguard drill --resize``):
  ``samples``: ``step``, ``drawn`` (the sample ids the step drew, with their places in the epoch's
  order), ``of``, ``loss``, every rank; ``marks``' ``state`` (a digest per model and optimizer), and
  the ``load`` marks of every rank.

Two runs of the same job that end with equal ``finish`` digests ended in bit-identical states: the
digest covers every byte of every entry of the checkpoint (model, optimizer, scheduler, data
position, RNG states), and nothing else (no times, no paths).

Readers trust nothing in the file: :func:`read` and :func:`read_new` validate every line against
one schema (:data:`SCHEMA`: each event's fields, their types, integers bounded) and report a
malformed line (``problems``) instead of passing it on, and they open the file with
``O_NOFOLLOW | O_NONBLOCK`` and refuse (:class:`RecordError`) anything but a regular file of this
user that no one else can write: a FIFO would hang the reader, another user's file could hold
forged events. :func:`check_path` says the same of a path before a tool hands it to a job; the
writer appends only to such a file too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["ENV", "VERSION", "PROGRESS_SECONDS", "SCHEMA", "RecordError", "Recorder", "check_path",
           "problem", "read", "read_new", "restart_count", "stop_times", "untrusted"]

log = logging.getLogger(__name__)

ENV = "SPOTGUARD_RECORD"
VERSION = 1
PROGRESS_SECONDS = 0.1
"""Rank 0 records progress at most ten times a second: fine enough to count the steps a kill lost."""
MAX_INT = 2**53
"""Bound of every integer field (steps, ranks, pids, sizes): what a JSON reader holds exactly."""

SCHEMA: dict[str, dict[str, str]] = {
    "*": {"t": "time", "pid": "count", "rank": "count", "job": "str?"},
    "start": {"root": "str", "world_size": "count?", "resumed_from": "count?", "skipped": "list?",
              "total": "count?", "entries": "list?", "loaded_digest": "str?", "cadence": "str?",
              "daemon": "bool?", "tier": "str?"},
    "progress": {"step": "count"},
    "commit": {"step": "count", "kind": "str?", "digest": "str?", "blocking_s": "seconds?",
               "persist_s": "seconds?", "bytes": "count?", "path": "str?", "mtbf_s": "seconds?",
               "mtbf_source": "str?"},
    "stop": {"step": "count", "saved": "bool?", "seconds_left": "number?", "notice": "dict?",
             "save": "str?", "estimate_s": "seconds?", "flagged_t": "time?", "stopped_t": "time?",
             "committed_t": "time?", "safe_t": "time?"},
    "finish": {"step": "count", "digest": "str"},
    "peer_lost": {"step": "count?", "error": "str?"},
    "forced_exit": {"reason": "str?"},
    "load_failed": {"error": "str?"},
    "data": {"step": "count", "ids": "str"},
    "marks": {"step": "count", "at": "str", "rng": "dict?", "lr": "list?", "epoch": "count?",
              "loss": "number?", "state": "dict?"},
    "samples": {"step": "count", "drawn": "list?", "of": "count?", "loss": "number?"},
    "unsaved": {"what": "str"},
    "ddp": {"entry": "str", "world_size": "count?"},
    "restore_failed": {"store": "str?", "store_step": "count?", "local_step": "count?", "error": "str?"},
}
"""Each event's fields and their types (``?``: may be absent or null); ``*`` applies to every
event. ``count``: an integer in [0, 2**53]; ``time``: a finite Unix time; ``seconds``: a finite
number >= 0. An event not named here is passed on with the common fields checked (a newer
library's)."""


class RecordError(OSError):
    """A record file a tool must not read or hand to a job: not a regular file, another user's, or
    writable by others."""


def _bad_type(kind: str, value: Any) -> bool:
    if kind in ("count", "time", "seconds", "number") and (isinstance(value, bool)
                                                         or not isinstance(value, (int, float))):
        return True
    if kind == "count":
        return not isinstance(value, int) or not 0 <= value <= MAX_INT
    if kind in ("time", "seconds", "number"):
        return not math.isfinite(value) or (kind != "number" and not 0 <= value < 2**40)
    return not isinstance(value, {"str": str, "bool": bool, "list": list, "dict": dict}[kind])


def problem(event: Any) -> str | None:
    """Why ``event`` (a decoded line) is not a valid record event, or None when it is."""
    if not isinstance(event, dict):
        return "not a JSON object"
    if event.get("v") != VERSION:
        return f"format {event.get('v')!r}, not {VERSION}"
    name = event.get("event")
    if not isinstance(name, str):
        return "no event name"
    for field, kind in {**SCHEMA["*"], **SCHEMA.get(name, {})}.items():
        optional, kind = kind.endswith("?"), kind.rstrip("?")
        value = event.get(field)
        if value is None:
            if not optional:
                return f"{name} event without {field!r}"
        elif _bad_type(kind, value):
            return f"{name} event with {field}={str(value)[:40]!r} (not a {kind})"
    return None


def restart_count() -> int | None:
    """How many times the scheduler or launcher restarted this job, when it says so."""
    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def stop_times(stop: dict[str, Any], flagged_at: Any, safe: bool) -> dict[str, Any]:
    """The ``stop`` event's timeline fields from what the stop reported to the daemon (``stop``:
    :class:`~spotguard.protocol.SafeRequest`'s fields, times as aware datetimes), when the flag was
    set and whether the daemon took the safe report (then, now)."""
    def unix(when: Any) -> float | None:
        return None if when is None else when.timestamp()

    return {"save": stop.get("save"), "estimate_s": stop.get("estimate_s"), "flagged_t": unix(flagged_at),
            "stopped_t": unix(stop.get("stopped_at")), "committed_t": unix(stop.get("committed_at")),
            "safe_t": time.time() if safe else None}


class Recorder:
    """Appends events to ``path`` (default ``$SPOTGUARD_RECORD``); does nothing without one."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, rank: int = 0, job: str = "") -> None:
        path = path if path is not None else os.environ.get(ENV) or None
        self.path = Path(path) if path else None
        self.rank, self.job = rank, job
        self.total: int | None = None
        """The step budget to record when a framework's loop, not Run's, decides it (the Lightning
        callback's ``max_steps``; Run's own loop is then given an endless one)."""
        self._next_progress = 0.0
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def start(self, *, root: str | os.PathLike[str], world_size: int, resumed_from: int | None,
              skipped: list[dict[str, str]], total: int | None, entries: list[str] | None = None,
              loaded_digest: str | None = None, cadence: str | None = None,
              daemon: bool | None = None, tier: str | None = None) -> None:
        """The run's start. ``cadence``: where its save cadence comes from (see
        :func:`spotguard._run_parts.cadence_source`; ``save_steps`` for the HF Trainer's own);
        ``daemon``: whether it listens to the daemon (False for ``Run(daemon=False)``); ``tier``:
        where the resumed step came from (``local``, ``peer`` or ``bucket``)."""
        total = self.total or total
        total = total if total is None or total <= MAX_INT else None  # an endless loop has no budget
        self.emit("start", root=str(root), world_size=world_size, argv=list(sys.argv),
                  cwd=os.getcwd(), host=socket.gethostname(), restart_count=restart_count(),
                  resumed_from=resumed_from, skipped=skipped, total=total, entries=entries,
                  loaded_digest=loaded_digest, cadence=cadence, daemon=daemon, tier=tier)

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
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                         | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
            try:
                _check_stat(os.fstat(fd), self.path)
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.debug("cannot append to the run record %s: %s", self.path, exc)


def check_path(path: str | os.PathLike[str]) -> None:
    """Refuse (:class:`RecordError`) a record path that exists and is not a regular file of this
    user that no one else can write; a path that does not exist yet passes (the job creates it,
    0600)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    _check_stat(info, path)


def untrusted(info: os.stat_result, directory: bool = False) -> str | None:
    """Why a file (a directory with ``directory``), by its ``lstat``, is not this user's alone: a
    link, another kind of file, another owner, writable by others; None when it is."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(info.st_mode):
        return "is not a directory" if directory else \
            "is not a regular file (a FIFO, a device or a directory)"
    if info.st_uid != os.geteuid():
        return (f"belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}): another "
                "user could have put what it holds there")
    if info.st_mode & 0o022:
        return f"can be written by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _check_stat(info: os.stat_result, path: str | os.PathLike[str]) -> None:
    why = untrusted(info)
    if why is not None:
        raise RecordError(f"the run record {path} {why}; refusing it (remove it, or choose another "
                          "path)")


def _read_from(path: str | os.PathLike[str], offset: int) -> bytes | None:
    """The bytes from ``offset`` on, None when there is no file; RecordError for a file that must
    not be trusted (opened without following a link or blocking on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise RecordError(f"the run record {path} is a symbolic link; refusing it") from exc
        raise
    with os.fdopen(fd, "rb") as file:
        _check_stat(os.fstat(fd), path)
        file.seek(offset)
        return file.read()


def read(path: str | os.PathLike[str], problems: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """The valid events of a record file in order. A malformed line is left out and, with
    ``problems``, described there; a last line cut short (a process killed mid-write) is left out
    silently. RecordError for a file that must not be trusted (see :func:`check_path`)."""
    data = _read_from(path, 0)
    if data is None:
        return
    lines = data.decode("utf-8", errors="replace").split("\n")
    yield from _events(lines[:-1] + ([] if not lines[-1] or _torn(lines[-1]) else lines[-1:]),
                       problems)


def _torn(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return True
    return False


def read_new(path: str | os.PathLike[str], offset: int,
             problems: list[str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """The valid events appended since byte ``offset`` and the offset to pass next time, for a
    reader that follows a live record: a last line not yet ended by a newline is left for the
    next call. Malformed lines and RecordError as for :func:`read`."""
    data = _read_from(path, offset)
    if data is None:
        return [], offset
    whole = data[: data.rfind(b"\n") + 1]
    lines = whole.decode("utf-8", errors="replace").splitlines()
    return list(_events(lines, problems)), offset + len(whole)


def _events(lines: list[str], problems: list[str] | None) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.strip():
            continue
        try:
            event = json.loads(line)
            why = problem(event)
        except (ValueError, RecursionError):
            why = "not JSON"
        if why is None:
            yield event
        elif problems is not None:
            problems.append(f"{why}: {line[:80]}")
