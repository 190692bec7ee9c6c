"""AWS EC2: Spot instance actions, rebalance recommendations and scheduled events, over IMDSv2.

Three watchers share one :class:`Imds` (one session token for all three paths):

* ``aws.spot``: ``spot/instance-action``; 404 while nothing is pending, else
  ``{"action": "terminate"|"stop"|"hibernate", "time": ...}``, about two minutes ahead. The id is
  ``aws:spot:<action>`` and the first deadline seen is kept while the action stays pending: a common
  mock recomputes ``time`` on every request.
* ``aws.rebalance``: ``events/recommendations/rebalance``; advisory (``terminating=False``), no
  deadline, id from the first ``noticeTime`` seen.
* ``aws.scheduled``: ``events/maintenance/scheduled``; one notice per active ``EventId``,
  deadline ``NotBefore`` (``21 Jan 2019 09:00:43 GMT``); canceled and completed events are left out,
  so they read as cancelled.

IMDSv1 (no token) is used only with ``aws.imdsv1_fallback``. A token PUT that times out logs one line
about the metadata hop limit, the usual cause inside containers.

Exceptions::

    WatcherError             the token could not be fetched (and IMDSv1 fallback is off)
     +-- BadPayload          a 200 whose body is not what AWS documents
    httpx.HTTPStatusError    an unexpected status (401 after a token refresh, 5xx, ...)
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import httpx
from spotguard.protocol import Kind, Notice

from ..settings import Settings
from ._common import MetadataToken, Sticky, iso, json_body
from .base import BadPayload, parse_time

__all__ = ["Imds", "AwsSpotWatcher", "AwsRebalanceWatcher", "AwsScheduledWatcher", "HOP_LIMIT_HINT"]

log = logging.getLogger(__name__)

HOP_LIMIT_HINT = (
    "inside a container this usually means the instance metadata hop limit is 1; raise it to 2 "
    "(aws ec2 modify-instance-metadata-options --http-put-response-hop-limit 2) or use host networking"
)
SPOT_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
SCHEDULED_PATH = "/latest/meta-data/events/maintenance/scheduled"

_SPOT_ACTIONS = {"terminate": Kind.TERMINATE, "stop": Kind.STOP, "hibernate": Kind.HIBERNATE}
_EVENT_CODES = {  # code -> (kind, terminating)
    "instance-stop": (Kind.STOP, True),
    "instance-retirement": (Kind.TERMINATE, True),
    "instance-reboot": (Kind.REBOOT, True),
    "system-reboot": (Kind.REBOOT, True),
    "system-maintenance": (Kind.MAINTENANCE, False),
}
_GONE_STATES = {"canceled", "cancelled", "completed"}


class Imds:
    """The instance metadata service as the AWS watchers see it: GETs with a shared IMDSv2 token."""

    def __init__(self, http: httpx.AsyncClient, settings: Settings) -> None:
        self.endpoint = settings.aws.endpoint.rstrip("/")
        self.token = MetadataToken(
            http, f"{self.endpoint}/latest/api/token",
            ttl_header="X-aws-ec2-metadata-token-ttl-seconds", token_header="X-aws-ec2-metadata-token",
            ttl=settings.aws.token_ttl, timeout=settings.runner.request_timeout, refresh_on=(401,),
            tokenless=settings.aws.imdsv1_fallback, timeout_hint=HOP_LIMIT_HINT,
        )
        self.poll_timeout = 4 * settings.runner.request_timeout + 1.0
        """Worst case of one GET: token PUT, GET, 401, PUT again, GET again."""

    async def get(self, path: str) -> httpx.Response | None:
        return await self.token.get(self.endpoint + path)


class _AwsWatcher:
    platform = "aws"
    name = ""
    advisory = False
    """Polled every ``aws.advisory_interval`` (minutes of lead time) rather than ``aws.interval``."""

    def __init__(self, imds: Imds, settings: Settings) -> None:
        self._imds = imds
        self.interval = settings.aws.advisory_interval if self.advisory else settings.aws.interval
        self.poll_timeout = imds.poll_timeout
        self._pending: Notice | None = None

    async def aclose(self) -> None:
        """The HTTP client belongs to the daemon; nothing to release here."""

    async def _pending_object(self, path: str) -> dict[str, Any] | None:
        """The JSON object at ``path``, or None (and no pending notice) on 404."""
        response = await self._imds.get(path)
        if response is None:
            self._pending = None
            return None
        return json_body(response, dict)


class AwsSpotWatcher(_AwsWatcher):
    """``aws.spot``: the Spot interruption notice (terminate, stop or hibernate)."""

    name = "aws.spot"

    async def poll(self) -> Sequence[Notice]:
        body = await self._pending_object(SPOT_PATH)
        if body is None:
            return []
        kind = _SPOT_ACTIONS.get(str(body.get("action", "")).lower())
        if kind is None:
            raise BadPayload(f"spot/instance-action: unknown action {body.get('action')!r:.40}")
        deadline = parse_time(str(body.get("time", "")))
        if self._pending is None or self._pending.kind != kind:
            self._pending = Notice(id=f"aws:spot:{kind.value}", platform="aws", kind=kind,
                                   deadline=deadline, source=self.name, raw=body,
                                   detail=f"EC2 Spot instance-action {kind.value}")
        return [self._pending]


class AwsRebalanceWatcher(_AwsWatcher):
    """``aws.rebalance``: the advisory rebalance recommendation (elevated interruption risk)."""

    name = "aws.rebalance"
    advisory = True

    async def poll(self) -> Sequence[Notice]:
        body = await self._pending_object(REBALANCE_PATH)
        if body is None:
            return []
        notice_time = parse_time(str(body.get("noticeTime", "")))
        if self._pending is None:
            self._pending = Notice(id=f"aws:rebalance:{iso(notice_time)}", platform="aws",
                                   kind=Kind.REBALANCE, terminating=False, source=self.name, raw=body,
                                   detail="EC2 rebalance recommendation: elevated interruption risk")
        return [self._pending]


class AwsScheduledWatcher(_AwsWatcher):
    """``aws.scheduled``: scheduled events (reboots, stops, retirement, system maintenance)."""

    name = "aws.scheduled"
    advisory = True

    def __init__(self, imds: Imds, settings: Settings) -> None:
        super().__init__(imds, settings)
        self._sticky = Sticky()

    async def poll(self) -> Sequence[Notice]:
        response = await self._imds.get(SCHEDULED_PATH)
        events = [] if response is None or not response.content.strip() else json_body(response, list)
        notices = [self._notice(event) for event in events if _active(event)]
        return self._sticky.keep(notices)

    def _notice(self, event: dict[str, Any]) -> Notice:
        event_id, code = event.get("EventId"), str(event.get("Code", ""))
        if not isinstance(event_id, str) or not event_id:
            raise BadPayload(f"scheduled event without EventId: {event!r:.80}")
        kind, terminating = _EVENT_CODES.get(code, (Kind.MAINTENANCE, False))
        if code not in _EVENT_CODES:
            log.debug("unknown scheduled event code %r read as advisory maintenance", code)
        deadline = parse_time(str(event.get("NotBefore", "")))
        return Notice(id=event_id, platform="aws", kind=kind, deadline=deadline,
                      terminating=terminating, source=self.name, raw=event,
                      detail=f"EC2 scheduled event {code}: {str(event.get('Description', ''))[:200]}")


def _active(event: Any) -> bool:
    if not isinstance(event, dict):
        raise BadPayload(f"scheduled event is not an object: {event!r:.80}")
    return str(event.get("State", "active")).lower() not in _GONE_STATES

