"""The loop around one watcher: pacing, timeouts, backoff with jitter, error counting, logging.

A :class:`Runner` polls its watcher until cancelled. Polls start every ``watcher.interval`` seconds
on a drift-free schedule (a slow poll does not push later polls back; missed ticks are skipped, not
bunched). Each poll is bounded by the watcher's ``poll_timeout`` (if it has one) else
``runner.request_timeout`` times four (a token PUT, a GET, and one retry of both); the watchers
bound each request by ``runner.request_timeout`` themselves.

After a successful poll the snapshot goes to the sink. A failed poll hands nothing to the sink (so
the store keeps the previous snapshot: no false notice, no false cancellation), and the next poll
waits for the later of the next tick and an exponential backoff with full jitter:
``uniform(0, min(cap, backoff_initial * 2 ** (failures - 1)))``, at least a 429/503's
``Retry-After`` when that is shorter than ``cap`` (a longer one is cut to ``cap``).

``cap`` bounds detection (see :func:`backoff_cap`): for a watcher that can raise a termination notice
it is the watcher's interval (at least ``backoff_initial``), so once the endpoint heals its notice is
seen within one interval plus the request in flight (``runner.request_timeout``), however long the
fault lasted. A metadata endpoint is link-local and private to the node: there is no herd to spread.
Only advisory watchers (``advisory = True``: lead times of minutes to days) back off to
``runner.backoff_max``.

Nothing a poll raises escapes :meth:`Runner.run` except cancellation. The log gets one line when
the watcher starts failing (with the reason), one reminder a minute while it keeps failing, and one
when it recovers (with the count), not one per poll. Every poll's outcome goes to the observer: ``ok``, ``http_error``, ``timeout``,
``connect_error``, ``bad_payload`` or ``error``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable, Sequence

import httpx
from spotguard.protocol import Notice

from ..settings import RunnerSettings
from ._common import describe
from .base import BadPayload, PollObserver, Watcher, WatcherError

__all__ = ["Runner", "backoff_cap", "backoff_delay", "classify", "retry_after"]

log = logging.getLogger(__name__)

Sink = Callable[[Watcher, Sequence[Notice]], None]

STILL_FAILING_LOG_SECONDS = 60.0
"""While a watcher keeps failing, one reminder line this often (the rest of the failures: DEBUG)."""


def backoff_cap(watcher: Watcher, settings: RunnerSettings) -> float:
    """The longest backoff after a failed poll of ``watcher``: what bounds detection after a fault.

    A watcher that can raise a termination notice is capped at its interval (at least
    ``backoff_initial``, for long-polls whose interval is 0), an advisory one at ``backoff_max``.
    """
    if getattr(watcher, "advisory", False):
        return settings.backoff_max
    return min(settings.backoff_max, max(watcher.interval, settings.backoff_initial))


def backoff_delay(failures: int, settings: RunnerSettings,
                  uniform: Callable[[float, float], float] = random.uniform,
                  cap: float | None = None) -> float:
    """Full-jitter exponential backoff after ``failures`` consecutive failures (>= 1), at most ``cap``
    (default ``backoff_max``)."""
    ceiling = settings.backoff_max if cap is None else cap
    return uniform(0.0, min(ceiling, settings.backoff_initial * 2.0 ** min(max(failures, 1) - 1, 64)))


def retry_after(exc: BaseException | None) -> float | None:
    """Seconds a 429 or 503 asked us to wait (``Retry-After`` in seconds), found along the causes."""
    while exc is not None:
        if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (429, 503):
            try:
                seconds = float(exc.response.headers.get("Retry-After", ""))
            except ValueError:
                return None  # absent, or an HTTP date: a metadata server sends seconds
            return seconds if 0 <= seconds < float("inf") else None
        exc = exc.__cause__
    return None


def classify(exc: BaseException) -> str:
    """The outcome label for a failed poll (a small fixed set, safe as a metrics label)."""
    if isinstance(exc, BadPayload):
        return "bad_payload"
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return "timeout"
    if isinstance(exc, (httpx.ConnectError, httpx.NetworkError)):
        return "connect_error"
    if isinstance(exc, (httpx.HTTPStatusError, httpx.ProtocolError, httpx.DecodingError)):
        return "http_error"
    if isinstance(exc, WatcherError) and exc.__cause__ is not None:
        return classify(exc.__cause__)  # e.g. a token PUT that failed: say how it failed
    return "error"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {exc.request.url.path}"
    return describe(exc)


class Runner:
    """Polls one watcher until cancelled; see the module docstring for the contract."""

    def __init__(self, watcher: Watcher, sink: Sink, settings: RunnerSettings,
                 observer: PollObserver | None = None, *,
                 uniform: Callable[[float, float], float] = random.uniform) -> None:
        self.watcher, self._sink, self._settings, self._observer = watcher, sink, settings, observer
        self._uniform = uniform
        self._last_exc: BaseException | None = None
        self._reminded = 0.0
        self.consecutive_failures = 0
        self.polls = 0
        self.last_error = ""
        """The reason of the latest failed poll ("" once healthy again)."""

    @property
    def healthy(self) -> bool:
        return self.consecutive_failures == 0

    async def run(self) -> None:
        """Poll until cancelled; CancelledError is the only exception that leaves."""
        tick = time.monotonic()
        while True:
            ok = await self.poll_once()
            now = time.monotonic()
            tick = max(tick + self.watcher.interval, now)
            delay = tick - now
            if not ok:
                delay = max(delay, self.next_delay())
                tick = now + delay
            await asyncio.sleep(delay)

    def next_delay(self) -> float:
        """The backoff after the latest failure: jittered, at least a short ``Retry-After``, at most
        :func:`backoff_cap`."""
        cap = backoff_cap(self.watcher, self._settings)
        delay = backoff_delay(self.consecutive_failures, self._settings, self._uniform, cap)
        asked = retry_after(self._last_exc)
        return delay if asked is None else max(delay, min(asked, cap))

    async def poll_once(self) -> bool:
        """One poll: the sink gets the snapshot on success; returns whether it succeeded."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._poll_timeout()):
                snapshot = list(await self.watcher.poll())
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            self._failed(TimeoutError("poll cancelled"), started)  # a watcher's own cancellation
            return False
        except Exception as exc:  # noqa: BLE001 - nothing a poll raises may end the loop
            self._failed(exc, started)
            return False
        self._succeeded(snapshot, started)
        return True

    def _poll_timeout(self) -> float:
        return getattr(self.watcher, "poll_timeout", None) or 4 * self._settings.request_timeout

    def _succeeded(self, snapshot: list[Notice], started: float) -> None:
        self.polls += 1
        self._observe("ok", started)
        if self.consecutive_failures:
            log.info("%s: recovered after %d failed poll(s)", self.watcher.name, self.consecutive_failures)
            self.consecutive_failures, self.last_error, self._last_exc = 0, "", None
        try:
            self._sink(self.watcher, snapshot)
        except Exception:  # noqa: BLE001 - a store bug must not stop the watching
            log.exception("%s: the notice sink failed", self.watcher.name)

    def _failed(self, exc: BaseException, started: float) -> None:
        self.polls += 1
        outcome = classify(exc)
        self._observe(outcome, started)
        self.last_error, self._last_exc = _reason(exc), exc
        self.consecutive_failures += 1
        now = time.monotonic()
        if self.consecutive_failures == 1:
            self._reminded = now
            log.warning("%s: poll failed (%s): %s; retrying within %.3g s", self.watcher.name, outcome,
                        self.last_error, backoff_cap(self.watcher, self._settings),
                        exc_info=outcome == "error")
        elif now - self._reminded >= STILL_FAILING_LOG_SECONDS:
            self._reminded = now
            log.warning("%s: still failing after %d polls (%s): %s", self.watcher.name,
                        self.consecutive_failures, outcome, self.last_error)
        else:
            log.debug("%s: poll failed again (%s): %s", self.watcher.name, outcome, self.last_error)

    def _observe(self, outcome: str, started: float) -> None:
        if self._observer is None:
            return
        try:
            self._observer.poll_done(self.watcher, outcome, time.monotonic() - started)
        except Exception:  # noqa: BLE001 - metrics must never stop the watching
            log.exception("poll observer failed")
