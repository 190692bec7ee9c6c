"""The daemon's background loops, kept alive: a loop that fails is logged, counted and started again.

Nothing a client sends and nothing a platform or a store does may stop the daemon (a daemon that
exits on a bad request can be kept down by one request every restart interval). Each long-lived
loop (serving requests, heartbeats, housekeeping, the storage check, one runner per watcher) runs
under :meth:`Supervisor.keep`: when it raises, or ends although it should not, the failure is
logged (with its traceback the first time a cause is seen, in one line after that), counted in
``spotguard_daemon_task_failures_total{task}``, and the loop is started again after a backoff that
doubles from ``FIRST_BACKOFF`` to ``MAX_BACKOFF`` seconds and starts over once a run lasted
``HEALTHY_SECONDS``. One-shot tasks run under :meth:`Supervisor.once`: a failure is logged and
counted, and nothing is retried. A loop made of independent steps (housekeeping) reports a failing
step with :meth:`Supervisor.failed` and goes on with the others.

Exceptions: none; cancellation (the daemon's shutdown) ends a loop as usual.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from prometheus_client import Counter

__all__ = ["Supervisor", "FIRST_BACKOFF", "MAX_BACKOFF", "HEALTHY_SECONDS"]

log = logging.getLogger(__name__)

FIRST_BACKOFF = 1.0
MAX_BACKOFF = 60.0
HEALTHY_SECONDS = 60.0
MAX_CAUSES = 256
"""Causes remembered for "traceback once per cause" (a cause may quote what a client sent)."""


class Supervisor:
    """Owns the daemon's tasks; :meth:`cancel_all` ends them at shutdown."""

    def __init__(self, restarts: Counter, *, first: float = FIRST_BACKOFF, ceiling: float = MAX_BACKOFF,
                 healthy: float = HEALTHY_SECONDS) -> None:
        self.restarts, self.first, self.ceiling, self.healthy = restarts, first, ceiling, healthy
        self.tasks: set[asyncio.Task] = set()
        self._seen: set[tuple[str, str]] = set()

    def keep(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run ``loop()`` until the daemon stops, starting it again whenever it fails or returns."""
        self._start(self._kept(name, loop))

    def once(self, name: str, coro: Awaitable[None]) -> None:
        """Run ``coro`` once; a failure is logged and counted, never fatal."""
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - nothing may stop the daemon
                self._failed(name, exc, "")
        self._start(guarded())

    def failed(self, name: str, exc: BaseException) -> None:
        """A step of a loop that goes on (housekeeping) failed: logged and counted like a task."""
        self._failed(name, exc, "; going on")

    async def cancel_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _start(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _kept(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        clock = asyncio.get_running_loop().time
        delay = self.first
        while True:
            started = clock()
            try:
                await loop()
                exc: BaseException | None = None
            except asyncio.CancelledError:
                raise
            except Exception as failure:  # noqa: BLE001 - nothing may stop the daemon
                exc = failure
            if clock() - started >= self.healthy:
                delay = self.first
            self._failed(name, exc, f"; starting it again in {delay:g} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.ceiling)

    def _failed(self, name: str, exc: BaseException | None, then: str) -> None:
        self.restarts.labels(task=name).inc()
        if exc is None:
            log.error("daemon task %s ended by itself%s", name, then)
            return
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        first = (name, cause) not in self._seen
        if len(self._seen) < MAX_CAUSES:
            self._seen.add((name, cause))
        log.error("daemon task %s failed (%s)%s", name, cause, then, exc_info=exc if first else None)
