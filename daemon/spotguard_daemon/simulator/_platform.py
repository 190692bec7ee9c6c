"""What every simulated platform shares: requests, responses, scheduled events and their flips.

A platform subclass (one module per platform) declares its ``kinds`` and answers metadata requests
in :meth:`PlatformSim.handle` from the events that are active *now*. Scheduling, cancelling and the
flip itself live here, so every platform flips the same way: under the shared condition, at the
planned time, with ``time.time()`` recorded and every waiter woken.

All state is guarded by one :class:`threading.Condition` shared with the fault book and the timer
thread; handlers that wait (GCP long-polls, slow first calls) wait on it, and :meth:`stop` wakes them.

Exceptions::

    ControlError             (from ._events) a schedule/cancel/set request that cannot be honoured
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from http import HTTPStatus
from dataclasses import dataclass, field
from email.message import Message
from typing import Any, Callable, ClassVar

from ._events import ControlError, SimEvent, Timers

__all__ = ["Request", "Response", "PlatformSim", "MAX_LEAD_SECONDS", "coerce", "html_error"]

logger = logging.getLogger(__name__)

MAX_LEAD_SECONDS = 7 * 24 * 3600.0
"""Longest ``in_seconds`` / ``deadline_seconds`` the control API accepts."""


def coerce(current: Any, value: Any, name: str) -> Any:
    """Convert ``value`` to the type of an option's ``current`` value (``"false"`` is False)."""
    if isinstance(current, bool):
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, (bool, int)):
            return bool(value)
        raise ControlError(f"{name} must be a boolean, got {value!r}")
    try:
        return type(current)(value)
    except (TypeError, ValueError):
        raise ControlError(f"{name} must be a {type(current).__name__}, got {value!r}") from None


@dataclass
class Request:
    """One HTTP request as the platform sees it; ``query`` keeps the first value of each key."""

    method: str
    path: str
    query: dict[str, str] = field(default_factory=dict)
    headers: Message = field(default_factory=Message)
    body: bytes = b""


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, status: int, text: str, content_type: str = "text/plain", **headers: str) -> "Response":
        return cls(status, text.encode(), content_type, dict(headers))

    @classmethod
    def json(cls, status: int, obj: Any, content_type: str = "application/json", **headers: str) -> "Response":
        return cls(status, json.dumps(obj).encode(), content_type, dict(headers))


def html_error(status: int, prolog: str = "") -> Response:
    """The small HTML error page metadata services answer errors with."""
    title = f"{status} - {HTTPStatus(status).phrase}"
    return Response.text(status, f"{prolog}<html><head><title>{title}</title></head>"
                                 f"<body><h1>{title}</h1></body></html>\n", "text/html")


class PlatformSim:
    """Base of one simulated platform. Subclasses set the class attributes and :meth:`handle`."""

    name: ClassVar[str] = ""
    kinds: ClassVar[tuple[str, ...]] = ()
    extra_fields: ClassVar[frozenset[str]] = frozenset()
    """Extra ``schedule`` fields this platform understands (kept in ``SimEvent.extra``)."""
    settable: ClassVar[frozenset[str]] = frozenset()
    """Options that ``POST /_sim/set`` may change while running."""
    server_header: ClassVar[str] = "spotguard-sim"

    def __init__(self, cond: threading.Condition, timers: Timers) -> None:
        self.cond = cond
        self.timers = timers
        self.events: dict[str, SimEvent] = {}
        self.stopping = False

    # ------------------------------------------------------------ hooks for subclasses

    def handle(self, req: Request) -> Response:
        """Answer one metadata request (called without the lock held)."""
        raise NotImplementedError

    def default_deadline(self, kind: str) -> float:
        return 120.0

    def new_event_id(self, kind: str) -> str:
        return "evt-" + secrets.token_hex(6)

    def validate(self, kind: str, event_type: str | None, extra: dict[str, Any]) -> None:
        """Refuse a schedule request this platform cannot show (raise :class:`ControlError`)."""

    def changed(self, event: SimEvent) -> None:
        """Called with the lock held after an event became visible, changed state, or went away."""

    def options(self) -> dict[str, Any]:
        """The platform's current options, for ``/_sim/state``."""
        return {key: getattr(self, key) for key in sorted(self.settable)}

    def extra_state(self) -> dict[str, Any]:
        return {}

    def expire_tokens(self) -> int:
        """Expire every session token; returns how many. Platforms without tokens have none."""
        return 0

    # ------------------------------------------------------------ control

    def schedule(self, kind: str, in_seconds: float = 0.0, deadline_seconds: float | None = None,
                 resources: list[str] | None = None, event_type: str | None = None,
                 duration: float | None = None, **extra: Any) -> SimEvent:
        """Schedule an event to become visible ``in_seconds`` from now (0: before this returns)."""
        self._check_schedule(kind, in_seconds, deadline_seconds, resources, extra)
        self.validate(kind, event_type, extra)
        lead = self.default_deadline(kind) if deadline_seconds is None else float(deadline_seconds)
        flip_at = time.time() + float(in_seconds)
        event = SimEvent(self.new_event_id(kind), kind, flip_at, flip_at + lead,
                         list(resources or []), event_type, duration, dict(extra))
        with self.cond:
            self.events[event.id] = event
            if in_seconds <= 0:
                self._flip(event)
            else:
                self.timers.call_at(flip_at, lambda: self._flip(event))
        return event

    def cancel(self, event_id: str | None = None) -> list[str]:
        """Cancel one event (or every unfinished one with ``None``); returns the ids cancelled."""
        with self.cond:
            if event_id is not None and event_id not in self.events:
                raise ControlError(f"no event {event_id!r}")
            targets = [self.events[event_id]] if event_id is not None else list(self.events.values())
            done = [ev.id for ev in targets if ev.state in ("pending", "active", "started")]
            for ev_id in done:
                self.end(self.events[ev_id], "cancelled")
            return done

    def clear_events(self) -> None:
        with self.cond:
            self.cancel()
            self.events.clear()

    def set(self, **fields: Any) -> None:
        unknown = set(fields) - self.settable
        if unknown:
            raise ControlError(f"{self.name}: cannot set {sorted(unknown)}; settable: {sorted(self.settable)}")
        with self.cond:
            for key, value in fields.items():
                setattr(self, key, coerce(getattr(self, key), value, key))
            self.cond.notify_all()

    def state(self) -> dict[str, Any]:
        with self.cond:
            events = [ev.to_json() for ev in self.events.values()]
            return {"platform": self.name, "kinds": list(self.kinds), "options": self.options(),
                    "events": events, **self.extra_state()}

    # ------------------------------------------------------------ helpers for subclasses

    def end(self, event: SimEvent, state: str) -> None:
        """Move an event to a final state (lock held)."""
        event.state = state
        event.ended_at = time.time()
        logger.info("simulator %s: event %s (%s) %s", self.name, event.id, event.kind, state)
        self.changed(event)
        self.cond.notify_all()

    def active(self, *kinds: str) -> list[SimEvent]:
        """Visible events of these kinds (all kinds when none given), oldest flip first. Lock held."""
        found = [ev for ev in self.events.values() if ev.active and (not kinds or ev.kind in kinds)]
        return sorted(found, key=lambda ev: (ev.flipped_at or 0.0, ev.created_at))

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait on the shared condition until ``predicate()`` or stop; False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: self.stopping or predicate(), timeout=max(0.0, timeout))

    # ------------------------------------------------------------ internals

    def _flip(self, event: SimEvent) -> None:
        if event.state != "pending":
            return
        event.state = "active"
        event.flipped_at = time.time()
        logger.info("simulator %s: event %s (%s) flipped", self.name, event.id, event.kind)
        self.changed(event)
        self.cond.notify_all()

    def _check_schedule(self, kind: str, in_seconds: float, deadline_seconds: float | None,
                        resources: list[str] | None, extra: dict[str, Any]) -> None:
        if kind not in self.kinds:
            raise ControlError(f"{self.name}: unknown kind {kind!r}; one of {list(self.kinds)}")
        for label, value in (("in_seconds", in_seconds), ("deadline_seconds", deadline_seconds)):
            if value is not None and not (0 <= float(value) <= MAX_LEAD_SECONDS):
                raise ControlError(f"{label} must be between 0 and {MAX_LEAD_SECONDS:.0f}")
        if resources is not None and not all(isinstance(r, str) for r in resources):
            raise ControlError("resources must be a list of strings")
        unknown = set(extra) - self.extra_fields
        if unknown:
            raise ControlError(f"{self.name}: unknown schedule fields {sorted(unknown)}")
