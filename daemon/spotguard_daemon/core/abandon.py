"""Blocking store calls that a stopping daemon abandons instead of waiting for.

A store call can block for minutes: an SDK retries inside one call (GCS: up to ``(connect + read
timeout) x attempts``, 200 s by default) and a stalled endpoint holds each attempt for the read
timeout. Nothing such a call does matters once the daemon stops: the upload journal is written
atomically and replayed at the next start, and the goodput copy is best effort. So:

* :func:`in_thread` runs a call on a daemon thread of its own (never asyncio's default executor,
  whose threads ``asyncio.run`` joins at the end, however long they take) and awaits it;
  cancelling the awaiting task abandons the call.
* :func:`exit_abandoning` ends the process once the daemon stopped. Threads that the SDKs' transfer
  pools started (``ThreadPoolExecutor``, s3transfer, GCS's transfer manager) are not daemon
  threads, and the interpreter would join them at exit; a ``ThreadPoolExecutor``'s workers are
  joined at exit even when they are daemon threads (a pool started from the daemon's upload thread
  inherits its daemon flag, and ``concurrent.futures`` joins its workers all the same: a SIGTERM
  during a stalled part upload once kept the process alive for minutes after "daemon stopped").
  When any such thread is still running, it says how many and leaves with ``os._exit`` after
  flushing the logs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import Any, Callable, NoReturn

__all__ = ["exit_abandoning", "in_thread"]

log = logging.getLogger(__name__)


async def in_thread(call: Callable[[], Any], name: str) -> Any:
    """``call()`` on a new daemon thread named ``name``; its result or exception. Cancelling the
    awaiting task returns at once and abandons the call (its outcome is dropped)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            error = exc  # ``exc`` is unbound when the except block ends; the callback runs later
            done = lambda: settle(lambda: future.set_exception(error))  # noqa: E731
        else:
            done = lambda: settle(lambda: future.set_result(result))  # noqa: E731
        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop is closed: the daemon stopped, nobody waits
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def _joined_at_exit() -> list[threading.Thread]:
    """Threads the interpreter would wait for at exit: non-daemon ones, and every pool worker."""
    from concurrent.futures import thread as pool_threads

    threads = {t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon}
    threads.update(getattr(pool_threads, "_threads_queues", {}).keys())  # joined by _python_exit
    return list(threads)


def exit_abandoning(status: int) -> NoReturn:
    """Exit with ``status`` now, abandoning any store call still in flight (see the module)."""
    pending = [t.name for t in _joined_at_exit() if t.is_alive()]
    if not pending:
        sys.exit(status)
    log.warning("abandoning %d store transfer thread(s) still running at exit (%s)", len(pending),
                ", ".join(sorted(set(pending)))[:200])
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
