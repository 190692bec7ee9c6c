"""The loop around one watcher: pacing, timeouts, backoff with jitter, error counting, logging.

A :class:`Runner` polls its watcher until cancelled. Polls start every ``watcher.interval`` seconds
on a drift-free schedule (a slow poll does not push later polls back; missed ticks are skipped, not
bunched). Each poll is bounded by the watcher's ``poll_timeout`` (if it has one) else
``runner.request_timeout`` times four (a token PUT, a GET, and one retry of both); the watchers
bound each request by ``runner.request_timeout`` themselves.

After a successful poll the snapshot goes to the sink. A failed poll hands nothing to the sink (so
the store keeps the previous snapshot: no false notice, no false cancellation), and the next poll
waits for the later of the next tick and an exponential backoff with full jitter:
``uniform(0, min(backoff_max, backoff_initial * 2 ** (failures - 1)))``.

Nothing a poll raises escapes :meth:`Runner.run` except cancellation. The log gets one line when
the watcher starts failing (with the reason) and one when it recovers (with the count), not one per
poll. Every poll's outcome goes to the observer: ``ok``, ``http_error``, ``timeout``,
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

__all__ = ["Runner", "backoff_delay", "classify"]

log = logging.getLogger(__name__)

Sink = Callable[[Watcher, Sequence[Notice]], None]


def backoff_delay(failures: int, settings: RunnerSettings,
                  uniform: Callable[[float, float], float] = random.uniform) -> float:
    """Full-jitter exponential backoff after ``failures`` consecutive failures (>= 1)."""
    cap = min(settings.backoff_max, settings.backoff_initial * 2.0 ** min(max(failures, 1) - 1, 64))
    return uniform(0.0, cap)


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
                delay = max(delay, backoff_delay(self.consecutive_failures, self._settings, self._uniform))
                tick = now + delay
            await asyncio.sleep(delay)

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
            self.consecutive_failures, self.last_error = 0, ""
        try:
            self._sink(self.watcher, snapshot)
        except Exception:  # noqa: BLE001 - a store bug must not stop the watching
            log.exception("%s: the notice sink failed", self.watcher.name)

    def _failed(self, exc: BaseException, started: float) -> None:
        self.polls += 1
        outcome = classify(exc)
        self._observe(outcome, started)
        self.last_error = _reason(exc)
        self.consecutive_failures += 1
        if self.consecutive_failures == 1:
            log.warning("%s: poll failed (%s): %s; backing off", self.watcher.name, outcome,
                        self.last_error, exc_info=outcome == "error")
        else:
            log.debug("%s: poll failed again (%s): %s", self.watcher.name, outcome, self.last_error)

    def _observe(self, outcome: str, started: float) -> None:
        if self._observer is None:
            return
        try:
            self._observer.poll_done(self.watcher, outcome, time.monotonic() - started)
        except Exception:  # noqa: BLE001 - metrics must never stop the watching
            log.exception("poll observer failed")
