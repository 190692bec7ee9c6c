"""GCP Compute Engine: preemption, host maintenance, and the legacy Preemptible 24-hour cap.

* ``gcp.preempted``: ``instance/preempted`` is ``TRUE`` -> PREEMPT, deadline 30 s after first seen, plus
  ``gcp.preemption_notice_duration`` on a Spot VM made with a metadata notice before the ACPI
  soft-off (``scheduling.preemptionNoticeDuration``; the metadata server does not say it).
* ``gcp.maintenance``: ``instance/maintenance-event`` is ``TERMINATE_ON_HOST_MAINTENANCE`` ->
  TERMINATE (terminating, about 60 s), ``MIGRATE_ON_HOST_MAINTENANCE`` -> advisory MAINTENANCE.
* ``gcp.preemptible``: a legacy Preemptible VM is stopped 24 h after boot whatever the capacity; a
  WALLTIME notice appears ``preemptible_lead`` seconds before boot time + ``preemptible_max_runtime``.

The first two read their value with a plain GET first (so a state already pending at start-up is
seen at once), then with ETag long-polls (``wait_for_change``) that return as soon as it changes.
Their ``interval`` is 0 while long-polling (the server paces them) and ``gcp.interval`` after a
long-poll that failed (plain polling for ``retry_long_poll_after`` seconds) or one that came back
quickly with nothing changed (a server that ignores ``wait_for_change`` must not make us spin).

Exceptions::

    WatcherError             (base.py)
     +-- BadPayload          a value GCP does not document
    httpx.HTTPStatusError    an unexpected status (503 during metadata-server maintenance, ...)
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, ClassVar, Sequence

import httpx
from spotguard.protocol import Kind, Notice, utcnow

from ..settings import Settings
from ._common import checked, iso
from .base import BadPayload

__all__ = ["MetadataValue", "GcpPreemptedWatcher", "GcpMaintenanceWatcher", "GcpPreemptibleWatcher",
           "read_boot_time"]

log = logging.getLogger(__name__)

FLAVOR = {"Metadata-Flavor": "Google"}
PREEMPT_NOTICE = timedelta(seconds=30)
MAINTENANCE_NOTICE = timedelta(seconds=60)


class MetadataValue:
    """One metadata value, read one step at a time: a plain GET, then ETag long-polls."""

    def __init__(self, http: httpx.AsyncClient, settings: Settings, path: str,
                 retry_long_poll_after: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._http, self._clock, self._retry_after = http, clock, retry_long_poll_after
        self._url = f"{settings.gcp.endpoint.rstrip('/')}/{path}"
        self._gcp, self._timeout = settings.gcp, settings.runner.request_timeout
        self._etag: str | None = None
        self._value: str | None = None
        self._plain_until = 0.0
        self.spacing = 0.0
        """Seconds the runner should wait before the next step (see the module docstring)."""
        self.poll_timeout = self._gcp.long_poll_timeout + 2 * self._timeout + 1.0

    @property
    def long_polling(self) -> bool:
        return self._gcp.long_poll and self._etag is not None and self._clock() >= self._plain_until

    async def read(self) -> str:
        """One step: the current value (after a change, or after the server's wait ran out)."""
        long_poll, started = self.long_polling, self._clock()
        try:
            response = await self._http.get(self._url, headers=FLAVOR, params=self._params(long_poll),
                                            timeout=self._timeout + (self._gcp.long_poll_timeout if long_poll else 0))
            checked(response, absent=())
        except httpx.HTTPError:
            if long_poll:
                self._fall_back()
            raise
        value, changed = response.text.strip(), response.text.strip() != self._value
        self._value, self._etag = value, response.headers.get("ETag")
        too_quick = long_poll and not changed and self._clock() - started < self._gcp.interval
        self.spacing = 0.0 if self.long_polling and not too_quick else self._gcp.interval
        return value

    def _params(self, long_poll: bool) -> dict[str, str]:
        if not long_poll:
            return {}
        return {"wait_for_change": "true", "last_etag": self._etag or "",
                "timeout_sec": str(self._gcp.long_poll_timeout)}

    def _fall_back(self) -> None:
        log.info("%s: long-poll failed; plain polling every %.1f s for %.0f s",
                 self._url, self._gcp.interval, self._retry_after)
        self._plain_until = self._clock() + self._retry_after
        self.spacing = self._gcp.interval


class _LongPollWatcher:
    """A watcher of one value: ``idle`` means nothing pending, ``values`` maps the others."""

    platform = "gcp"
    name = ""
    path = ""
    idle = ""
    values: ClassVar[dict[str, tuple[Kind, bool, timedelta]]] = {}  # value -> (kind, terminating, lead)

    def __init__(self, http: httpx.AsyncClient, settings: Settings, *,
                 retry_long_poll_after: float = 60.0) -> None:
        self._value = MetadataValue(http, settings, self.path, retry_long_poll_after)
        self.poll_timeout = self._value.poll_timeout
        self._pending: Notice | None = None

    @property
    def interval(self) -> float:
        return self._value.spacing

    async def aclose(self) -> None:
        """The HTTP client belongs to the daemon; nothing to release here."""

    async def poll(self) -> Sequence[Notice]:
        value = (await self._value.read()).upper()
        if value == self.idle:
            self._pending = None
            return []
        if value not in self.values:
            raise BadPayload(f"{self.path}: {value[:40]!r}")
        return self._keep(*self.values[value], value)

    def _keep(self, kind: Kind, terminating: bool, lead: timedelta, value: str) -> list[Notice]:
        """The pending notice, made when ``kind`` is first seen and kept while it stays."""
        if self._pending is None or self._pending.kind != kind:
            deadline = utcnow() + lead
            self._pending = Notice(id=f"gcp:{kind.value}", platform="gcp", kind=kind,
                                   deadline=deadline, terminating=terminating, source=self.name,
                                   raw=value, detail=f"{self.path} = {value}")
        return [self._pending]


class GcpPreemptedWatcher(_LongPollWatcher):
    """``gcp.preempted``: Spot/Preemptible preemption (about 30 s of notice)."""

    name = "gcp.preempted"
    path = "instance/preempted"
    idle = "FALSE"
    values = {"TRUE": (Kind.PREEMPT, True, PREEMPT_NOTICE)}

    def __init__(self, http: httpx.AsyncClient, settings: Settings, **kwargs: float) -> None:
        super().__init__(http, settings, **kwargs)
        self._notice = settings.gcp.preemption_notice_duration
        if self._notice:
            self.values = {"TRUE": (Kind.PREEMPT, True, PREEMPT_NOTICE + timedelta(seconds=self._notice))}

    def _keep(self, kind: Kind, terminating: bool, lead: timedelta, value: str) -> list[Notice]:
        notices = super()._keep(kind, terminating, lead, value)
        if self._notice and "notice duration" not in notices[0].detail:
            self._pending = notices[0].model_copy(update={"detail": f"{notices[0].detail} (preemption notice "
                                                                    f"duration {self._notice:g} s + 30 s soft-off)"})
        return [self._pending]


class GcpMaintenanceWatcher(_LongPollWatcher):
    """``gcp.maintenance``: host maintenance; GPU VMs are terminated, others live-migrate."""

    name = "gcp.maintenance"
    path = "instance/maintenance-event"
    idle = "NONE"
    values = {"TERMINATE_ON_HOST_MAINTENANCE": (Kind.TERMINATE, True, MAINTENANCE_NOTICE),
              "MIGRATE_ON_HOST_MAINTENANCE": (Kind.MAINTENANCE, False, MAINTENANCE_NOTICE)}


def read_boot_time(proc_stat: Path = Path("/proc/stat")) -> float:
    """Boot time (Unix seconds) from the ``btime`` line of ``/proc/stat``."""
    for line in proc_stat.read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise OSError(f"{proc_stat}: no btime line")


class GcpPreemptibleWatcher:
    """``gcp.preemptible``: the legacy Preemptible VM's 24-hour cap, as a WALLTIME notice.

    With ``gcp.preemptible = "auto"`` the first poll asks ``instance/scheduling/preemptible``; a VM
    that is not preemptible then costs nothing more. Boot time comes from ``boot_time()``.
    """

    platform = "gcp"
    name = "gcp.preemptible"

    def __init__(self, http: httpx.AsyncClient, settings: Settings,
                 boot_time: Callable[[], float] = read_boot_time) -> None:
        self._http, self._gcp, self._boot_time = http, settings.gcp, boot_time
        self._timeout = settings.runner.request_timeout
        self._enabled: bool | None = {"yes": True, "no": False}.get(settings.gcp.preemptible)
        self.interval = settings.gcp.interval
        self.poll_timeout = self._timeout + 1.0
        self._pending: Notice | None = None
        self._boot: float | None = None

    async def aclose(self) -> None:
        """The HTTP client belongs to the daemon; nothing to release here."""

    async def poll(self) -> Sequence[Notice]:
        if self._enabled is None:
            self._enabled = await self._ask()
            log.info("legacy Preemptible VM: %s", "yes, watching the 24 h cap" if self._enabled else "no")
        if not self._enabled:
            return []
        if self._boot is None:
            self._boot = self._boot_time()  # fixed until the next boot; read once
        deadline = datetime.fromtimestamp(self._boot + self._gcp.preemptible_max_runtime, timezone.utc)
        if utcnow() < deadline - timedelta(seconds=self._gcp.preemptible_lead):
            return []
        if self._pending is None or self._pending.deadline != deadline:
            self._pending = Notice(id=f"gcp:walltime:{iso(deadline)}", platform="gcp", kind=Kind.WALLTIME,
                                   deadline=deadline, source=self.name,
                                   detail="legacy Preemptible VMs are stopped after 24 h of running")
        return [self._pending]

    async def _ask(self) -> bool:
        url = f"{self._gcp.endpoint.rstrip('/')}/instance/scheduling/preemptible"
        response = checked(await self._http.get(url, headers=FLAVOR, timeout=self._timeout), absent=())
        value = response.text.strip().upper()
        if value not in ("TRUE", "FALSE"):
            raise BadPayload(f"instance/scheduling/preemptible: {value[:40]!r}")
        return value == "TRUE"
