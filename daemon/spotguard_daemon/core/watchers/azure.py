"""Azure: Scheduled Events (Preempt, Terminate, Reboot, Redeploy, Freeze) for this VM.

``GET /metadata/scheduledevents`` (header ``Metadata: true``) returns the whole availability set's
pending events; this watcher keeps those whose ``Resources`` name this VM (``azure.vm_name``, else
read once from IMDS). One notice per ``EventId``, deadline ``NotBefore`` (RFC 1123; an empty
``NotBefore`` on a ``Started`` event means now). An event that completes or is cancelled disappears
from the document, which the notice store reads as a cancellation. Freeze events shorter than
``azure.freeze_threshold`` seconds are ignored. The first call after boot may take two minutes, so
it gets ``azure.first_call_timeout``.

:meth:`AzureScheduledWatcher.acknowledge` POSTs ``StartRequests`` so that Azure starts the event
early once the work is safe (the daemon core decides when).

Exceptions::

    WatcherError             the VM name could not be read, or an acknowledgement never went through
     +-- BadPayload          a 200 whose body is not what Azure documents
    httpx.HTTPStatusError    an unexpected status
"""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import datetime
from typing import Any, Sequence

import httpx
from spotguard.protocol import TERMINATING_KINDS, Kind, Notice, utcnow

from ..settings import Settings
from ._common import Sticky, checked, describe, json_body
from .base import BadPayload, WatcherError, parse_time

__all__ = ["AzureScheduledWatcher", "EVENTS_PATH", "NAME_PATH"]

log = logging.getLogger(__name__)

EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
HEADERS = {"Metadata": "true"}
ACK_ATTEMPTS = 3
_VM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")
"""Azure VM names: letters, digits, ``_ . -``, at most 64 (Linux) or 15 (Windows) characters."""
_TYPES = {"Preempt": Kind.PREEMPT, "Terminate": Kind.TERMINATE, "Reboot": Kind.REBOOT,
          "Redeploy": Kind.REDEPLOY, "Freeze": Kind.FREEZE}


class AzureScheduledWatcher:
    """``azure.scheduled``: this VM's Scheduled Events, one notice per EventId."""

    platform = "azure"
    name = "azure.scheduled"

    def __init__(self, http: httpx.AsyncClient, settings: Settings, *, ack_backoff: float = 0.5) -> None:
        self._http, self._azure, self._ack_backoff = http, settings.azure, ack_backoff
        self._base = settings.azure.endpoint.rstrip("/")
        self._timeout = settings.runner.request_timeout
        self._vm_name = settings.azure.vm_name
        self._answered = False
        self._incarnation: Any = None
        self._sticky = Sticky()
        self.interval = settings.azure.interval

    @property
    def poll_timeout(self) -> float:
        """The runner's bound on one poll: the first call after boot may take minutes."""
        first = 0.0 if self._answered else self._azure.first_call_timeout
        return first + 2 * self._timeout + 1.0

    async def aclose(self) -> None:
        """The HTTP client belongs to the daemon; nothing to release here."""

    async def poll(self) -> Sequence[Notice]:
        vm = await self._vm()
        timeout = self._timeout if self._answered else self._azure.first_call_timeout
        response = checked(await self._http.get(self._base + EVENTS_PATH, headers=HEADERS,
                                                timeout=timeout), absent=())
        self._answered = True
        document = json_body(response, dict)
        events = document.get("Events", [])
        if not isinstance(events, list):
            raise BadPayload(f"scheduledevents: Events is not a list: {events!r:.64}")
        notices = [n for n in (self._notice(event, vm) for event in events) if n is not None]
        self._note_incarnation(document.get("DocumentIncarnation"), len(notices))
        return self._sticky.keep(notices)

    async def acknowledge(self, event_ids: Sequence[str]) -> None:
        """Ask Azure to start these events now (``StartRequests``); retried a few times.

        Raises :class:`WatcherError` when every attempt failed.
        """
        if not event_ids:
            return
        body = {"StartRequests": [{"EventId": event_id} for event_id in event_ids]}
        for attempt in range(1, ACK_ATTEMPTS + 1):
            try:
                checked(await self._http.post(self._base + EVENTS_PATH, json=body, headers=HEADERS,
                                              timeout=self._timeout), absent=())
                log.info("acknowledged scheduled events %s", ", ".join(event_ids))
                return
            except httpx.HTTPError as exc:
                error = exc
                if attempt < ACK_ATTEMPTS:
                    await asyncio.sleep(self._ack_backoff * 2 ** (attempt - 1))
        raise WatcherError(f"StartRequests for {len(event_ids)} event(s) failed "
                           f"{ACK_ATTEMPTS} times: {describe(error)}")

    async def _vm(self) -> str:
        if self._vm_name is None:
            try:
                response = checked(await self._http.get(self._base + NAME_PATH, headers=HEADERS,
                                                        timeout=self._timeout), absent=())
            except httpx.HTTPError as exc:
                raise WatcherError(f"cannot read this VM's name from IMDS: {describe(exc)}") from exc
            name = response.text.strip()
            if not _VM_NAME.fullmatch(name):
                raise BadPayload(f"compute/name: not a VM name: {name[:64]!r}")
            self._vm_name = name
            log.info("this VM is %r in Scheduled Events", name)
        return self._vm_name

    def _notice(self, event: Any, vm: str) -> Notice | None:
        if not isinstance(event, dict) or not isinstance(event.get("EventId"), str) or not event["EventId"]:
            raise BadPayload(f"scheduled event without EventId: {event!r:.80}")
        kind = _TYPES.get(str(event.get("EventType", "")))
        resources = event.get("Resources") or []
        if kind is None or not isinstance(resources, list):
            return None
        if vm.casefold() not in (str(r).casefold() for r in resources) or self._short_freeze(kind, event):
            return None
        return Notice(id=event["EventId"], platform="azure", kind=kind,
                      deadline=self._deadline(event), terminating=kind in TERMINATING_KINDS,
                      source=self.name, raw=event,
                      detail=f"Azure {event.get('EventType')} ({event.get('EventStatus', '')}): "
                             f"{str(event.get('Description', ''))[:200]}")

    def _deadline(self, event: dict[str, Any]) -> datetime | None:
        not_before = str(event.get("NotBefore") or "").strip()
        if not_before:
            return parse_time(not_before)
        previous = self._sticky.get(event["EventId"])
        if previous is not None and previous.deadline is not None:
            return previous.deadline
        return utcnow() if event.get("EventStatus") == "Started" else None

    def _short_freeze(self, kind: Kind, event: dict[str, Any]) -> bool:
        if kind is not Kind.FREEZE:
            return False
        try:
            duration = float(event.get("DurationInSeconds", -1))
        except (TypeError, ValueError):
            return False
        return duration != -1 and duration < self._azure.freeze_threshold

    def _note_incarnation(self, incarnation: Any, count: int) -> None:
        if incarnation != self._incarnation:
            log.info("scheduled events: DocumentIncarnation %s -> %s (%d event(s) for this VM)",
                     self._incarnation, incarnation, count)
            self._incarnation = incarnation
