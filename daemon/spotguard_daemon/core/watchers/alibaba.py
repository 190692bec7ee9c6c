"""Alibaba Cloud ECS: the preemptible instance's termination time.

``GET /latest/meta-data/instance/spot/termination-time`` answers 404 while nothing is pending, else
an RFC 3339 UTC time (the instance is released then, a few minutes after the notice appears) ->
PREEMPT, terminating, id ``alibaba:preempt:<time>``. In hardened mode (``alibaba.hardened``, the
default) every GET carries a session token from ``PUT /latest/api/token``; a 401 or 403 drops the
token, fetches a new one and retries once.

Exceptions::

    WatcherError             the hardened-mode token could not be fetched
     +-- BadPayload          a 200 whose body is not a time
    httpx.HTTPStatusError    an unexpected status
"""

from __future__ import annotations

from typing import Sequence

import httpx
from spotguard.protocol import Kind, Notice

from ..settings import Settings
from ._common import MetadataToken, checked, iso
from .base import parse_time

__all__ = ["AlibabaPreemptWatcher", "TERMINATION_PATH"]

TERMINATION_PATH = "/latest/meta-data/instance/spot/termination-time"


class AlibabaPreemptWatcher:
    """``alibaba.preempt``: the preemptible (spot) instance release notice."""

    platform = "alibaba"
    name = "alibaba.preempt"

    def __init__(self, http: httpx.AsyncClient, settings: Settings) -> None:
        self._http = http
        self._base = settings.alibaba.endpoint.rstrip("/")
        self._timeout = settings.runner.request_timeout
        self.interval = settings.alibaba.interval
        self.poll_timeout = 4 * self._timeout + 1.0
        self.token: MetadataToken | None = None
        if settings.alibaba.hardened:
            self.token = MetadataToken(
                http, f"{self._base}/latest/api/token", ttl_header="X-aliyun-ecs-metadata-token-ttl-seconds",
                token_header="X-aliyun-ecs-metadata-token", ttl=settings.alibaba.token_ttl,
                timeout=self._timeout, refresh_on=(401, 403),
            )
        self._pending: Notice | None = None

    async def aclose(self) -> None:
        """The HTTP client belongs to the daemon; nothing to release here."""

    async def poll(self) -> Sequence[Notice]:
        url = self._base + TERMINATION_PATH
        if self.token is not None:
            response = await self.token.get(url)
        else:
            response = checked(await self._http.get(url, timeout=self._timeout))
        if response is None:
            self._pending = None
            return []
        deadline = parse_time(response.text)
        if self._pending is None:
            self._pending = Notice(id=f"alibaba:preempt:{iso(deadline)}", platform="alibaba",
                                   kind=Kind.PREEMPT, deadline=deadline, source=self.name,
                                   raw=response.text.strip()[:64],
                                   detail="ECS preemptible instance is being released")
        return [self._pending]
