"""Delivery of a notice beyond the sockets: a signal to the training processes, a hook, a webhook.

Not every training script imports the client library, so on a *terminating* notice the daemon also
sends ``delivery.signal`` (SIGUSR1 by default) to every process that registered, every pid named in
``delivery.pid_files`` and every process in the ``delivery.cgroup``'s ``cgroup.procs``. Processes are
never found by name (no pgrep: a name matches strangers). pid 1, pids <= 0 and the daemon itself are
never signalled, nor is a client that registered as not handling the signal (a Guard outside the
main thread: SIGUSR1's default action would kill it); a pid that is gone is skipped and logged.

The hook (argv list, the notice JSON on stdin) and the webhook (a JSON POST with an optional bearer
secret, which is never logged) run for every notice as background tasks with a timeout per attempt
and ``delivery.attempts`` tries with exponential backoff, so a slow receiver never blocks the loop.
:meth:`Delivery.drain` waits for the ones still running, bounded, at shutdown.

The notices it signalled for, with when, and when each was cancelled, are kept ``RECENT_SECONDS``
(:meth:`Delivery.recent`, in the ``status`` reply's ``signalled``): a client whose SIGUSR1 arrives
after the notice behind it was cancelled (a platform that withdrew its notice 50 ms later) tells it
from a signal nobody announced (Slurm's ``--signal``), so a withdrawn notice never turns into a stop.

Exceptions::

    DeliveryError            one hook or webhook attempt failed (retried, then logged)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal as _signal
import time
from pathlib import Path
from typing import Callable, Iterable

import httpx
from spotguard.protocol import Notice, encode
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from spotguard_daemon.core.settings import DeliverySettings

__all__ = ["Delivery", "DeliveryError", "signal_pids", "listed_pids"]

log = logging.getLogger(__name__)

Outcome = Callable[[str, bool], None]
RECENT_SECONDS = 300.0
"""How long a signalled notice stays in :meth:`Delivery.recent` after its signal or its cancel."""


class DeliveryError(Exception):
    """One hook or webhook attempt failed."""


def listed_pids(pid_files: Iterable[Path], cgroup: Path | None) -> set[int]:
    """The pids named in ``pid_files`` (one each) and in ``<cgroup>/cgroup.procs``; unreadable or
    malformed files are logged and skipped."""
    pids: set[int] = set()
    sources = list(pid_files) + ([cgroup / "cgroup.procs"] if cgroup is not None else [])
    for path in sources:
        try:
            pids.update(int(word) for word in path.read_text().split())
        except (OSError, ValueError) as exc:
            log.warning("cannot read pids from %s: %s", path, exc)
    return pids


def signal_pids(pids: Iterable[int], signum: int) -> list[int]:
    """Send ``signum`` to each pid that is safe to signal; return those that received it."""
    sent = []
    for pid in sorted(set(pids)):
        if pid <= 1 or pid == os.getpid():
            log.warning("refusing to signal pid %d", pid)
            continue
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            log.info("pid %d is gone; not signalled", pid)
        except PermissionError:
            log.warning("no permission to signal pid %d", pid)
        else:
            sent.append(pid)
    return sent


class Delivery:
    """Acts on announced notices; ``registered`` returns the pids of the registered clients."""

    def __init__(self, settings: DeliverySettings, registered: Callable[[], Iterable[int]],
                 http: httpx.AsyncClient | None = None, outcome: Outcome | None = None,
                 backoff: float = 0.5, refused: Callable[[], Iterable[int]] = tuple) -> None:
        """``refused``: the pids of clients that registered as not handling the signal (its default
        action would kill them), left out even when a pid file or the cgroup lists them."""
        self._settings = settings
        self._registered = registered
        self._refused = refused
        self._http = http
        self._outcome = outcome or (lambda channel, ok: None)
        self._backoff = backoff
        self._tasks: set[asyncio.Task] = set()
        self._signalled: dict[str, dict[str, float | None]] = {}
        self._sent_to: dict[str, set[int]] = {}

    def deliver(self, notice: Notice) -> list[int]:
        """Signal now (for terminating notices) and start the hook and webhook in the background;
        return the pids signalled."""
        sent = self.send_signal(notice)
        payload = encode(notice)
        if self._settings.hook:
            self._spawn(self._retry("hook", self._run_hook, payload))
        if self._settings.webhook is not None and self._http is not None:
            self._spawn(self._retry("webhook", self._post_webhook, payload))
        return sent

    def send_signal(self, notice: Notice, *, missed_only: bool = False) -> list[int]:
        """Signal the registered, listed and not refusing pids; with ``missed_only``, only those
        not signalled for this notice yet (clients that registered again after it went out)."""
        if not notice.terminating or self._settings.signal == "none":
            return []
        signum = _signal.Signals[self._settings.signal]
        targets = set(self._registered()) | listed_pids(self._settings.pid_files, self._settings.cgroup)
        targets -= set(self._refused())
        if missed_only:
            targets -= self._sent_to.get(notice.id, set())
            if not targets:
                return []
        sent = signal_pids(targets, signum)
        log.info("notice %s: sent %s to %d of %d processes%s", notice.id, signum.name, len(sent), len(targets),
                 " that registered again after it went out" if missed_only else "")
        if sent:
            self._forget(time.time())
            self._signalled.setdefault(notice.id, {"at": time.time(), "cancelled_at": None})
            self._sent_to.setdefault(notice.id, set()).update(sent)
        for _ in sent:
            self._outcome("signal", True)
        return sent

    def cancelled(self, notice_id: str) -> None:
        """The notice was withdrawn: its signals stay explained until ``RECENT_SECONDS`` later."""
        if notice_id in self._signalled:
            self._signalled[notice_id]["cancelled_at"] = time.time()

    def recent(self) -> dict[str, dict[str, float | None]]:
        """``{notice id: {"at": epoch seconds signalled, "cancelled_at": ... or None}}`` of the last
        ``RECENT_SECONDS``."""
        self._forget(time.time())
        return {notice_id: dict(times) for notice_id, times in self._signalled.items()}

    def _forget(self, now: float) -> None:
        for notice_id, times in list(self._signalled.items()):  # oldest first; at most 256 kept
            if (times["cancelled_at"] or times["at"]) + RECENT_SECONDS < now or len(self._signalled) > 256:
                del self._signalled[notice_id]
                self._sent_to.pop(notice_id, None)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retry(self, channel: str, attempt: Callable, payload: bytes) -> bool:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._settings.attempts),
            wait=wait_exponential(multiplier=self._backoff, max=30),
            retry=retry_if_exception_type(DeliveryError), reraise=True)
        try:
            async for state in retrying:
                with state:
                    await self._bounded(attempt, payload)
        except DeliveryError as exc:
            log.warning("%s failed after %d attempts: %s", channel, self._settings.attempts, exc)
            self._outcome(channel, False)
            return False
        self._outcome(channel, True)
        return True

    async def _bounded(self, attempt: Callable, payload: bytes) -> None:
        try:
            await asyncio.wait_for(attempt(payload), self._settings.timeout)
        except asyncio.TimeoutError:
            raise DeliveryError(f"timed out after {self._settings.timeout:g} s") from None

    async def _run_hook(self, payload: bytes) -> None:
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._settings.hook, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise DeliveryError(f"hook {self._settings.hook[0]!r} cannot start: {exc}") from exc
        try:
            _out, err = await proc.communicate(payload)
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise DeliveryError(f"hook exited {proc.returncode}: {err.decode(errors='replace')[-200:]}")

    async def _post_webhook(self, payload: bytes) -> None:
        headers = {"Content-Type": "application/json"}
        if self._settings.webhook_secret is not None:
            headers["Authorization"] = f"Bearer {self._settings.webhook_secret.get_secret_value()}"
        try:
            response = await self._http.post(str(self._settings.webhook), content=payload, headers=headers)
        except httpx.HTTPError as exc:
            raise DeliveryError(f"webhook: {type(exc).__name__}") from exc
        if response.status_code >= 300:
            raise DeliveryError(f"webhook answered {response.status_code}")

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` seconds for hooks and webhooks still running, then cancel them."""
        if not self._tasks:
            return
        _done, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
