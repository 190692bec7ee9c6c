"""Slurm: the job's walltime, raised as a WALLTIME notice ``slurm.lead`` seconds before the end.

Inside an allocation (``SLURM_JOB_ID`` set) the job's end time is read with
``squeue -h -j $SLURM_JOB_ID -o %e`` (falling back to ``scontrol show job``). Slurm prints it in the
local time of the command, in the format ``$SLURM_TIME_FORMAT`` asks for (``relative``, ``%s``, ...),
so both commands run with ``TZ=UTC0`` and ``SLURM_TIME_FORMAT=standard``: the answer is then always
UTC, such as ``2026-11-21T20:30:00``, whatever the daemon's or the user's settings. The snapshot is empty until ``end - lead``, then holds one notice whose
deadline is the end time and whose id names the end time, so an ``scontrol update TimeLimit=...``
that moves the end replaces the notice (the old one is cancelled), and so does a preemption with a
``GraceTime``, which moves the end to the preemption plus the grace. ``N/A``/``Unknown`` mean no limit
(a job without a time limit shows an end a year ahead, which raises nothing).

The end time rarely changes, so it is read every ``slurm.interval`` seconds; ``interval`` shrinks as
``end - lead`` approaches so that the notice appears on time, not up to one interval late.

Exceptions::

    WatcherError             neither squeue nor scontrol told the end time (missing, failed, hung)
     +-- BadPayload          they answered with something that is not a time
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Mapping, Sequence

from spotguard.protocol import Kind, Notice, utcnow

from ..settings import Settings
from ._common import iso
from .base import BadPayload, WatcherError

__all__ = ["SLURM_ENV", "SlurmWalltimeWatcher", "parse_end_time"]

log = logging.getLogger(__name__)

_NO_LIMIT = {"", "N/A", "UNKNOWN", "NONE", "UNLIMITED", "INVALID"}
_END_TIME = re.compile(r"\bEndTime=(\S+)")
MIN_INTERVAL = 0.05


SLURM_ENV = {"TZ": "UTC0", "SLURM_TIME_FORMAT": "standard"}
"""Set for squeue and scontrol: times in UTC, ISO 8601, whatever the environment says."""


def parse_end_time(text: str) -> datetime | None:
    """Slurm's ``%e`` / ``EndTime=`` value, printed under :data:`SLURM_ENV` (UTC), as aware UTC; None
    when there is no limit. An explicit offset is honoured."""
    text = text.strip()
    if text.upper() in _NO_LIMIT:
        return None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise BadPayload(f"slurm end time {text[:40]!r}") from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=timezone.utc)
    return parsed.astimezone(timezone.utc)


class SlurmWalltimeWatcher:
    """``slurm.walltime``: the allocation's end time, read from squeue (or scontrol)."""

    platform = "slurm"
    name = "slurm.walltime"

    def __init__(self, settings: Settings, environ: Mapping[str, str] = os.environ, *,
                 command_timeout: float | None = None) -> None:
        self._slurm = settings.slurm
        self.job_id = environ.get("SLURM_JOB_ID", "")
        self._env = {**environ, **SLURM_ENV}
        self._timeout = command_timeout or max(settings.runner.request_timeout, 10.0)
        self.poll_timeout = 2 * self._timeout + 1.0
        self.interval = settings.slurm.interval
        self._pending: Notice | None = None

    async def aclose(self) -> None:
        """Nothing is held between polls."""

    async def poll(self) -> Sequence[Notice]:
        end = await self.end_time()
        self.interval = self._slurm.interval
        if end is None:
            return []
        until_lead = (end - timedelta(seconds=self._slurm.lead) - utcnow()).total_seconds()
        if until_lead > 0:
            self.interval = max(MIN_INTERVAL, min(self._slurm.interval, until_lead))
            return []
        if self._pending is None or self._pending.deadline != end:
            self._pending = Notice(id=f"slurm:walltime:{self.job_id}:{iso(end)}", platform="slurm",
                                   kind=Kind.WALLTIME, deadline=end, source=self.name,
                                   detail=f"Slurm job {self.job_id} reaches its time limit")
        return [self._pending]

    async def end_time(self) -> datetime | None:
        """The job's end time: squeue first, scontrol when squeue fails or does not know the job."""
        squeue, why = self._slurm.squeue, "no output"
        try:
            out = await self._run(squeue, "-h", "-j", self.job_id, "-o", "%e")
            if out.strip():
                return parse_end_time(out.splitlines()[0])
        except WatcherError as exc:
            why = str(exc)
        scontrol = str(Path(squeue).with_name("scontrol")) if "/" in squeue else "scontrol"
        try:
            out = await self._run(scontrol, "show", "job", self.job_id)
        except WatcherError as exc:
            raise WatcherError(f"{why}; then {exc}") from exc
        match = _END_TIME.search(out)
        if match is None:
            raise BadPayload(f"scontrol show job {self.job_id}: no EndTime")
        return parse_end_time(match.group(1))

    async def _run(self, program: str, *args: str) -> str:
        try:
            proc = await asyncio.create_subprocess_exec(
                program, *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self._env)
        except OSError as exc:
            raise WatcherError(f"{program}: {exc.strerror or exc}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self._timeout)
        except BaseException as exc:  # timed out, or the poll was cancelled: leave no orphan
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if isinstance(exc, asyncio.TimeoutError):
                raise WatcherError(f"{program} did not answer within {self._timeout:.0f} s") from None
            raise
        if proc.returncode != 0:
            raise WatcherError(f"{program} exited {proc.returncode}: {err.decode(errors='replace')[:200].strip()}")
        return out.decode(errors="replace")
