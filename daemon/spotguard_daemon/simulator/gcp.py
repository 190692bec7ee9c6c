"""Simulated GCP Compute Engine metadata server: preemption, host maintenance, long-polls.

Every request needs ``Metadata-Flavor: Google`` (else 403) and every answer carries
``Metadata-Flavor: Google`` and an ``ETag`` (16 hex digits of a SHA-256 of the value, so equal values
have equal ETags). Values, as plain text:

* ``instance/preempted``: ``TRUE`` while a ``preempt`` event is active, else ``FALSE``;
* ``instance/maintenance-event``: ``NONE``, ``MIGRATE_ON_HOST_MAINTENANCE`` (kind ``migrate``) or
  ``TERMINATE_ON_HOST_MAINTENANCE`` (kind ``terminate_maintenance``), the latest flip winning;
* ``instance/scheduling/preemptible``: ``TRUE``/``FALSE`` from the ``preemptible`` option
  (settable at run time).

A Spot VM made with ``scheduling.preemptionNoticeDuration`` (the ``preemption_notice_duration``
option, seconds, settable) shows ``preempted`` that long before its ACPI soft-off, and goes 30 s
after that: a ``preempt`` event's default deadline is the duration plus 30 s. Like the real server,
it does not publish the duration.

``?wait_for_change=true&last_etag=X&timeout_sec=N`` waits on the shared condition (no polling) until
the value's ETag differs from ``X`` (without ``last_etag``: from the value now), or ``N`` seconds
pass (default and cap :data:`MAX_WAIT_SECONDS`), or the simulator stops; then it answers the current
value. A flip wakes it at once.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Callable

from ._events import Timers
from ._platform import PlatformSim, Request, Response
from ._simulator import register_platform

__all__ = ["GcpSim", "etag", "MAX_WAIT_SECONDS"]

_BASE = "/computeMetadata/v1/"
MAX_WAIT_SECONDS = 3600
_DEFAULT_WAIT_SECONDS = 300
_FLAVOR = {"Metadata-Flavor": "Google"}


def etag(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


@register_platform
class GcpSim(PlatformSim):
    name = "gcp"
    kinds = ("preempt", "terminate_maintenance", "migrate")
    settable = frozenset({"preemptible", "preemption_notice_duration"})
    server_header = "Metadata Server for VM"

    def __init__(self, cond: threading.Condition, timers: Timers, *, preemptible: bool = True,
                 preemption_notice_duration: float = 0.0) -> None:
        super().__init__(cond, timers)
        self.preemptible = bool(preemptible)
        self.preemption_notice_duration = float(preemption_notice_duration)
        self._values: dict[str, Callable[[], str]] = {
            "instance/preempted": lambda: "TRUE" if self.active("preempt") else "FALSE",
            "instance/maintenance-event": self._maintenance_event,
            "instance/scheduling/preemptible": lambda: "TRUE" if self.preemptible else "FALSE",
        }

    def default_deadline(self, kind: str) -> float:
        return 30.0 + self.preemption_notice_duration if kind == "preempt" else 60.0

    def handle(self, req: Request) -> Response:
        if req.headers.get("Metadata-Flavor") != "Google":
            return Response.text(403, "Missing Metadata-Flavor:Google header.\n", "text/html", **_FLAVOR)
        if req.method not in ("GET", "HEAD"):
            return Response.text(405, "Method Not Allowed\n", "text/html", **_FLAVOR)
        value_of = self._values.get(req.path[len(_BASE):]) if req.path.startswith(_BASE) else None
        if value_of is None:
            return Response.text(404, "Not Found\n", "text/html", **_FLAVOR)
        if req.query.get("wait_for_change", "").lower() == "true":
            timeout = _wait_seconds(req.query.get("timeout_sec"))
            if timeout is None:
                return Response.text(400, "Invalid timeout_sec\n", "text/html", **_FLAVOR)
            value = self._wait_for_change(value_of, req.query.get("last_etag"), timeout)
        else:
            with self.cond:
                value = value_of()
        return Response.text(200, value, "application/text", ETag=etag(value), **_FLAVOR)

    def _wait_for_change(self, value_of: Callable[[], str], last: str | None, timeout: float) -> str:
        with self.cond:
            last = last or etag(value_of())
            self.cond.wait_for(lambda: self.stopping or etag(value_of()) != last, timeout=timeout)
            return value_of()

    def _maintenance_event(self) -> str:
        events = self.active("terminate_maintenance", "migrate")
        if not events:
            return "NONE"
        return "TERMINATE_ON_HOST_MAINTENANCE" if events[-1].kind == "terminate_maintenance" \
            else "MIGRATE_ON_HOST_MAINTENANCE"


def _wait_seconds(text: str | None) -> float | None:
    """``timeout_sec`` as seconds (default when absent, capped); ``None`` when not a positive integer."""
    if text is None:
        return float(_DEFAULT_WAIT_SECONDS)
    try:
        seconds = int(text)
    except ValueError:
        return None
    return float(min(seconds, MAX_WAIT_SECONDS)) if seconds > 0 else None
