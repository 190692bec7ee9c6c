"""Simulated Azure Instance Metadata Service: Scheduled Events and the VM's name.

``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true`` (else 400, as is a
missing ``api-version``) returns ``{"DocumentIncarnation": n, "Events": [...]}``; ``n`` increments
on every change (an event appears, starts, or goes away). Each event has ``EventId`` (an upper-case
UUID, also the simulator's event id), ``EventType`` (the kind), ``ResourceType: VirtualMachine``,
``Resources`` (default ``[vm_name]``), ``EventStatus``, ``NotBefore`` (RFC 1123), ``Description``,
``EventSource: Platform`` and ``DurationInSeconds`` (``duration``; default 9 for Freeze, else -1).

Life of an event: ``Scheduled`` from its flip; ``Started`` when acknowledged (``POST`` the same URL
with ``{"StartRequests": [{"EventId": ...}]}``, recorded in ``/_sim/state`` under ``acks``) or when
its ``NotBefore`` passes; gone ``started_linger`` seconds later (or at once when cancelled).

``GET /metadata/instance/compute/name?api-version=2021-02-01&format=text`` returns ``vm_name``.
``first_call_delay`` makes the first Scheduled Events GET wait that many seconds, as the real
service does for up to two minutes after boot.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

from ._events import SimEvent, Timers
from ._platform import PlatformSim, Request, Response
from ._simulator import register_platform
from ._timefmt import rfc1123

__all__ = ["AzureSim"]

_EVENTS_PATH = "/metadata/scheduledevents"
_NAME_PATH = "/metadata/instance/compute/name"
_DEADLINES = {"Preempt": 30.0, "Terminate": 300.0, "Reboot": 900.0, "Redeploy": 600.0, "Freeze": 900.0}
_DESCRIPTIONS = {
    "Preempt": "Virtual machine is being preempted.",
    "Terminate": "Virtual machine is being deleted.",
    "Reboot": "Virtual machine is going to be restarted as requested by authorized user.",
    "Redeploy": "Virtual machine is being moved to another host.",
    "Freeze": "Host server is undergoing maintenance.",
}
_MAX_ACKS = 1000


def _error(text: str) -> Response:
    return Response.json(400, {"error": text}, "application/json; charset=utf-8")


@register_platform
class AzureSim(PlatformSim):
    name = "azure"
    kinds = tuple(_DEADLINES)
    settable = frozenset({"vm_name", "first_call_delay", "started_linger"})
    server_header = "Microsoft-IIS/10.0"

    def __init__(self, cond: threading.Condition, timers: Timers, *, vm_name: str = "vm-0",
                 first_call_delay: float = 0.0, started_linger: float = 5.0, incarnation: int = 1) -> None:
        super().__init__(cond, timers)
        self.vm_name = str(vm_name)
        self.first_call_delay = float(first_call_delay)
        self.started_linger = float(started_linger)
        self.incarnation = int(incarnation)
        self.acks: list[dict[str, Any]] = []
        self._first_call_done = False

    def default_deadline(self, kind: str) -> float:
        return _DEADLINES[kind]

    def new_event_id(self, kind: str) -> str:
        return str(uuid.uuid4()).upper()

    def changed(self, event: SimEvent) -> None:
        self.incarnation += 1
        if event.state == "active":
            self.timers.call_at(event.deadline, lambda: self._start(event))

    def extra_state(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "acks": [dict(ack) for ack in self.acks]}

    def handle(self, req: Request) -> Response:
        if req.headers.get("Metadata", "").lower() != "true":
            return _error("Bad request. Required metadata header not specified")
        if "api-version" not in req.query:
            return _error("Bad request. api-version was not specified in the request. "
                          "For more information refer to aka.ms/azureimds")
        if req.path == _NAME_PATH and req.method in ("GET", "HEAD"):
            return self._vm_name(req)
        if req.path != _EVENTS_PATH:
            return Response.json(404, {"error": "Not found"}, "application/json; charset=utf-8")
        if req.method == "POST":
            return self._acknowledge(req)
        if req.method not in ("GET", "HEAD"):
            return Response.json(405, {"error": "Method not allowed"}, "application/json; charset=utf-8")
        self._maybe_slow_first_call()
        with self.cond:
            return Response.json(200, self._document(), "application/json; charset=utf-8")

    # ------------------------------------------------------------ endpoints

    def _vm_name(self, req: Request) -> Response:
        with self.cond:
            name = self.vm_name
        if req.query.get("format") == "text":
            return Response.text(200, name, "text/plain; charset=utf-8")
        return Response.json(200, name, "application/json; charset=utf-8")

    def _maybe_slow_first_call(self) -> None:
        with self.cond:
            first, self._first_call_done = not self._first_call_done, True
            delay = self.first_call_delay
        if first and delay > 0:
            self.wait(lambda: False, delay)

    def _document(self) -> dict[str, Any]:
        return {"DocumentIncarnation": self.incarnation,
                "Events": [self._event_json(ev) for ev in self.active()]}

    def _event_json(self, ev: SimEvent) -> dict[str, Any]:
        duration = ev.duration if ev.duration is not None else (9 if ev.kind == "Freeze" else -1)
        return {"EventId": ev.id, "EventStatus": "Started" if ev.state == "started" else "Scheduled",
                "EventType": ev.kind, "ResourceType": "VirtualMachine",
                "Resources": list(ev.resources or [self.vm_name]), "NotBefore": rfc1123(ev.deadline),
                "Description": _DESCRIPTIONS[ev.kind], "EventSource": "Platform",
                "DurationInSeconds": int(duration)}

    def _acknowledge(self, req: Request) -> Response:
        try:
            ids = [str(item["EventId"]) for item in json.loads(req.body)["StartRequests"]]
        except (ValueError, TypeError, KeyError):
            return _error("Bad request. The body must be {\"StartRequests\": [{\"EventId\": ...}]}")
        with self.cond:
            for event_id in ids:
                event = self.events.get(event_id)
                self.acks.append({"event_id": event_id, "at": time.time(), "known": event is not None})
                if event is not None:
                    self._start(event)
            del self.acks[:-_MAX_ACKS]
        return Response(200, b"", "application/json; charset=utf-8")

    # ------------------------------------------------------------ life cycle (lock held)

    def _start(self, event: SimEvent) -> None:
        """Scheduled -> Started; the event disappears ``started_linger`` seconds later."""
        if event.state != "active":
            return
        event.state = "started"
        self.incarnation += 1
        self.cond.notify_all()
        self.timers.call_at(time.time() + self.started_linger, lambda: self._finish(event))

    def _finish(self, event: SimEvent) -> None:
        if event.state == "started":
            self.end(event, "done")
