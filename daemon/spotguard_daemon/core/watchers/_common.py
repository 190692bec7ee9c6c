"""What the HTTP watchers share: status handling, JSON bodies, metadata session tokens, sticky notices.

A watcher translates transport trouble once, here: an unexpected status becomes
``httpx.HTTPStatusError`` (the runner counts it as ``http_error``), an unparsable 200 becomes
:class:`~spotguard_daemon.core.watchers.base.BadPayload`, a token that cannot be had becomes
:class:`~spotguard_daemon.core.watchers.base.WatcherError`.

Exceptions::

    WatcherError             (base.py) the metadata token could not be fetched
     +-- BadPayload          a 200 whose body is not what the platform documents
    httpx.HTTPStatusError    a status the watcher does not expect
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from typing import Any, Callable

import httpx
from spotguard.protocol import Notice

from .base import BadPayload, WatcherError

__all__ = ["MetadataToken", "Sticky", "checked", "describe", "json_body", "iso", "MAX_BODY_BYTES"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
"""A metadata answer larger than this is garbage, whatever it says."""
TOKENLESS_RETRY_SECONDS = 60.0
"""After a failed token PUT with token-less fallback on, how long to stay token-less."""


def iso(moment: datetime) -> str:
    """``2017-09-18T08:22:00Z``: the form used inside notice ids."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe(exc: BaseException) -> str:
    """``Type: message`` in one short line (httpx timeouts have an empty message)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def checked(response: httpx.Response, absent: tuple[int, ...] = (404,)) -> httpx.Response | None:
    """None for an 'absent' status (nothing pending), the response for a 2xx, else raise.

    Raises ``httpx.HTTPStatusError`` for any other status and :class:`BadPayload` for an
    oversized body.
    """
    if response.status_code in absent:
        return None
    response.raise_for_status()
    if len(response.content) > MAX_BODY_BYTES:
        raise BadPayload(f"{len(response.content)} byte answer from {response.url.path}")
    return response


def json_body(response: httpx.Response, expect: type) -> Any:
    """The JSON body, which must be an instance of ``expect`` (dict or list); else BadPayload."""
    try:
        value = response.json()
    except ValueError:
        raise BadPayload(f"{response.url.path}: not JSON: {response.text[:64]!r}") from None
    if not isinstance(value, expect):
        raise BadPayload(f"{response.url.path}: expected a JSON {expect.__name__}, got {value!r:.64}")
    return value


class MetadataToken:
    """A cached metadata session token (AWS IMDSv2, Alibaba hardened mode), used for every GET.

    The token is fetched with one PUT, cached, and refreshed a little before it expires. A GET
    answered with one of ``refresh_on`` drops the token, fetches a new one and retries once (the
    platform restarted its metadata service, or the token expired early). With ``tokenless=True``
    a failed PUT falls back to token-less requests for a minute (IMDSv1); without it the failure is a
    :class:`WatcherError`. ``timeout_hint`` is logged once when a PUT times out.
    """

    def __init__(self, http: httpx.AsyncClient, url: str, *, ttl_header: str, token_header: str,
                 ttl: int, timeout: float, refresh_on: tuple[int, ...] = (401,),
                 tokenless: bool = False, timeout_hint: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._http, self._url, self._ttl, self._timeout = http, url, ttl, timeout
        self._ttl_header, self._token_header = ttl_header, token_header
        self._refresh_on, self._tokenless, self._hint, self._clock = refresh_on, tokenless, timeout_hint, clock
        self._token: str | None = None
        self._expires = 0.0
        self._tokenless_until = 0.0
        self._hinted = False
        self._lock = asyncio.Lock()
        self.fetches = 0
        """Token PUTs sent so far (tests and debugging)."""

    def invalidate(self, refused: str | None = None) -> None:
        """Drop the token (only if it is still ``refused``: another watcher may have renewed it)."""
        if refused is None or refused == self._token:
            self._token = None

    async def get(self, url: str, absent: tuple[int, ...] = (404,)) -> httpx.Response | None:
        """GET ``url`` with the token; see :func:`checked` for the result and the errors."""
        for attempt in (1, 2):
            token = await self._current()
            headers = {self._token_header: token} if token else {}
            response = await self._http.get(url, headers=headers, timeout=self._timeout)
            if response.status_code not in self._refresh_on or not token or attempt == 2:
                return checked(response, absent)
            log.info("metadata token refused (HTTP %d); fetching a new one", response.status_code)
            self.invalidate(token)
        raise AssertionError("unreachable")

    async def _current(self) -> str | None:
        async with self._lock:  # watchers sharing this token wait for one PUT, not one each
            return await self._renewed()

    async def _renewed(self) -> str | None:
        now = self._clock()
        if self._token is not None and now < self._expires:
            return self._token
        if self._tokenless and now < self._tokenless_until:
            return None
        try:
            self._token = await self._fetch()
        except (httpx.HTTPError, BadPayload) as exc:
            return self._put_failed(exc)
        self._expires = now + self._ttl - min(60.0, self._ttl * 0.1)
        return self._token

    async def _fetch(self) -> str:
        self.fetches += 1
        response = await self._http.put(self._url, headers={self._ttl_header: str(self._ttl)},
                                        timeout=self._timeout)
        response.raise_for_status()
        token = response.text.strip()
        if not token or len(token) > 4096 or not token.isprintable():
            raise BadPayload("metadata token PUT answered without a usable token")
        return token

    def _put_failed(self, exc: Exception) -> None:
        if isinstance(exc, httpx.TimeoutException) and self._hint and not self._hinted:
            self._hinted = True
            log.warning("metadata token PUT to %s timed out: %s", self._url, self._hint)
        if not self._tokenless:
            raise WatcherError(f"metadata token PUT failed ({describe(exc)})") from exc
        log.warning("metadata token PUT failed (%s); using token-less requests for %.0f s",
                    type(exc).__name__, TOKENLESS_RETRY_SECONDS)
        self._tokenless_until = self._clock() + TOKENLESS_RETRY_SECONDS
        return None


class Sticky:
    """Keeps a notice's first-seen ``received_at`` (and, for a given id, more) across polls.

    Snapshot watchers rebuild their notices every poll; this makes the rebuilt notice equal to the
    first one where nothing real changed, and forgets ids that left the snapshot.
    """

    def __init__(self) -> None:
        self._seen: dict[str, Notice] = {}

    def get(self, notice_id: str) -> Notice | None:
        return self._seen.get(notice_id)

    def keep(self, notices: list[Notice]) -> list[Notice]:
        kept = []
        for notice in notices:
            old = self._seen.get(notice.id)
            if old is not None:
                notice = notice.model_copy(update={"received_at": old.received_at})
            kept.append(notice)
        self._seen = {notice.id: notice for notice in kept}
        return kept
