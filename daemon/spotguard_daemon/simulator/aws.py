"""Simulated AWS EC2 instance metadata (IMDSv2) for spot notices, rebalance and scheduled events.

Token rules as on EC2: ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
(1..21600, else 400) returns a token; GETs send it as ``X-aws-ec2-metadata-token``. A missing token
gets 401 unless the simulator was started with ``imdsv1=True``; an unknown or expired token always
gets 401. Endpoints:

* ``spot/instance-action``: 404, or ``{"action": "terminate|stop|hibernate", "time": RFC 3339}``
  (``time`` is the event's deadline, fixed for the event: it is not recomputed per request);
* ``spot/termination-time``: legacy plain text, only for ``terminate``;
* ``events/recommendations/rebalance``: 404, or ``{"noticeTime": RFC 3339 of the flip}``;
* ``events/maintenance/scheduled``: always 200, a JSON array (``[]`` when none) with ``NotBefore``
  (the deadline) and ``NotAfter`` in the ``21 Jan 2019 09:00:43 GMT`` format; a cancelled event
  moves to ``events/maintenance/history`` with ``State: canceled``.

Kinds: ``terminate``, ``stop``, ``hibernate``, ``rebalance``, ``scheduled`` (``event_type`` is the
``Code``, default ``system-reboot``; ``duration`` the window length; extra field ``state`` forces
``active``/``completed``/``canceled`` in the scheduled list, as some mocks return).
"""

from __future__ import annotations

import secrets
import threading
from typing import Any, Callable

from ._events import ControlError, SimEvent, Timers
from ._platform import Request, Response, html_error
from ._simulator import register_platform
from ._timefmt import aws_event_time, rfc3339
from ._tokens import TokenGuardedSim

__all__ = ["AwsSim"]

_MD = "/latest/meta-data/"
_SPOT_ACTIONS = ("terminate", "stop", "hibernate")
_CODES = {
    "instance-reboot": "scheduled reboot",
    "system-reboot": "scheduled reboot",
    "system-maintenance": "scheduled maintenance",
    "instance-retirement": "scheduled retirement",
    "instance-stop": "scheduled stop",
}
_STATES = ("active", "completed", "canceled")


def _html(status: int) -> Response:
    return html_error(status, '<?xml version="1.0" encoding="iso-8859-1"?>\n')


@register_platform
class AwsSim(TokenGuardedSim):
    name = "aws"
    kinds = ("terminate", "stop", "hibernate", "rebalance", "scheduled")
    extra_fields = frozenset({"state"})
    settable = frozenset({"imdsv1"})
    server_header = "EC2ws"
    ttl_header = "X-aws-ec2-metadata-token-ttl-seconds"
    token_header = "X-aws-ec2-metadata-token"

    def __init__(self, cond: threading.Condition, timers: Timers, *, imdsv1: bool = False,
                 instance_id: str = "i-0123456789abcdef0") -> None:
        super().__init__(cond, timers)
        self.imdsv1 = bool(imdsv1)
        self.instance_id = instance_id
        self._routes: dict[str, Callable[[], Response]] = {
            _MD + "spot/instance-action": self._instance_action,
            _MD + "spot/termination-time": self._termination_time,
            _MD + "events/recommendations/rebalance": self._rebalance,
            _MD + "events/maintenance/scheduled": lambda: self._maintenance(history=False),
            _MD + "events/maintenance/history": lambda: self._maintenance(history=True),
            _MD + "instance-id": lambda: Response.text(200, self.instance_id),
        }

    def default_deadline(self, kind: str) -> float:
        return {"rebalance": 600.0, "scheduled": 7 * 24 * 3600.0}.get(kind, 120.0)

    def new_event_id(self, kind: str) -> str:
        if kind == "scheduled":
            return "instance-event-" + secrets.token_hex(9)[:17]
        return f"aws-{kind}-" + secrets.token_hex(6)

    def validate(self, kind: str, event_type: str | None, extra: dict[str, Any]) -> None:
        if event_type is not None and event_type not in _CODES:
            raise ControlError(f"aws: event_type (the scheduled event's Code) must be one of {sorted(_CODES)}")
        if extra.get("state", "active") not in _STATES:
            raise ControlError(f"aws: state must be one of {list(_STATES)}")

    def tokens_required(self) -> bool:
        return not self.imdsv1

    def error(self, status: int) -> Response:
        return _html(status)

    def route(self, req: Request) -> Response:
        route = self._routes.get(req.path)
        return route() if route else _html(404)

    # ------------------------------------------------------------ endpoints (lock held)

    def _instance_action(self) -> Response:
        actions = self.active(*_SPOT_ACTIONS)
        if not actions:
            return _html(404)
        latest = actions[-1]
        return Response.json(200, {"action": latest.kind, "time": rfc3339(latest.deadline)}, "text/plain")

    def _termination_time(self) -> Response:
        terminations = self.active("terminate")
        if not terminations:
            return _html(404)
        return Response.text(200, rfc3339(terminations[-1].deadline))

    def _rebalance(self) -> Response:
        notices = self.active("rebalance")
        if not notices:
            return _html(404)
        return Response.json(200, {"noticeTime": rfc3339(notices[0].flipped_at or 0.0)}, "text/plain")

    def _maintenance(self, history: bool) -> Response:
        if history:
            events = [ev for ev in self.events.values() if ev.kind == "scheduled" and ev.state == "cancelled"]
        else:
            events = self.active("scheduled")
        return Response.json(200, [self._scheduled_json(ev) for ev in events], "text/plain")

    def _scheduled_json(self, ev: SimEvent) -> dict[str, str]:
        code = ev.event_type or "system-reboot"
        state = "canceled" if ev.state == "cancelled" else ev.extra.get("state", "active")
        return {"NotBefore": aws_event_time(ev.deadline), "Code": code, "Description": _CODES[code],
                "EventId": ev.id, "NotAfter": aws_event_time(ev.deadline + (ev.duration or 1000.0)),
                "State": state}
