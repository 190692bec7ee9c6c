"""A minimal thread pool that keeps working while the interpreter shuts down, and thread niceness.

``concurrent.futures.ThreadPoolExecutor`` refuses new work once the main thread has returned
(its atexit hook runs before non-daemon threads are joined), which would make a save that is still
in flight when a training script ends fail silently. These workers are daemon threads fed by a
queue: they live as long as the non-daemon save thread that owns them needs them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from spotguard._priority import lower_priority

__all__ = ["Workers", "Throttle", "lower_priority"]


class Throttle:
    """Caps the CPU used by the threads that call :meth:`run` to ``share`` of one CPU in total
    (no cap from ``share >= threads`` on): each piece of work's CPU seconds (user + system: a
    page-cache write counts) are charged to one ledger, and the thread that ran it sleeps until the
    ledger is back within ``share`` of the time gone by (at most :data:`BURST` of idle time is
    banked). One ledger, not a fixed part per thread: when one thread waits on the disk the other
    may use the whole share (split evenly, a core's share on two threads got half a core's work
    done with a core idle). Niceness alone does not keep a save from
    slowing training: the loop's idle gaps, SMT siblings and memory bandwidth are shared whatever
    the priority. :meth:`lift` lifts the cap at once and for good (an emergency save waits for this
    one); an ``adaptive`` throttle's share is moved by :class:`~._budget.Budget` with :meth:`set`,
    which also holds the work back for a few steps with :meth:`pause` (never longer than it says)."""

    def __init__(self, share: float | None, threads: int = 2, adaptive: bool = False) -> None:
        if share is not None and not 0 < share <= threads:
            raise ValueError(f"cpu share must be in (0, {threads}]")
        self.share = None if share is None or share >= threads else share
        self.threads, self.adaptive, self.lifted = threads, adaptive, False
        self._going = threading.Event()
        self._going.set()
        self._resume_at = 0.0
        self._ledger = threading.Lock()
        self._free_at = time.monotonic()
        """When the CPU charged so far is within the share (monotonic seconds): nothing banked at first."""

    def set(self, share: float) -> None:
        """A new share (cores), unless the cap was lifted."""
        if not self.lifted:
            self.share = share

    def pause(self, seconds: float) -> None:
        """Start no new piece of work for up to ``seconds`` (the budget's control window)."""
        if not self.lifted:
            self._resume_at = time.monotonic() + seconds
            self._going.clear()

    def resume(self) -> None:
        self._going.set()

    @property
    def paused(self) -> bool:
        """Work is held back now (a pause that ran out no longer holds it)."""
        return not self._going.is_set() and self._resume_at > time.monotonic()

    def lift(self) -> None:
        self.lifted, self.share = True, None
        self._going.set()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        while not self._going.is_set() and (left := self._resume_at - time.monotonic()) > 0:
            self._going.wait(left)
        start = time.thread_time()
        result = fn(*args)
        used, share = time.thread_time() - start, self.share
        if share is not None and share < self.threads:
            with self._ledger:
                now = time.monotonic()
                self._free_at = max(self._free_at, now - BURST) + used / share
                delay = self._free_at - now
            if delay > 0:
                time.sleep(delay)
        return result


BURST = 0.05
"""Seconds of idle share a throttle banks: a thread back from a wait may run this long unpaced."""


class Workers:
    """``n`` threads running submitted calls in order of submission; use as a context manager."""

    def __init__(self, n: int, name: str, nice: int | None = None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, args=(nice,), name=name, daemon=True)
                         for _ in range(n)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _loop(self, nice: int | None) -> None:
        lower_priority(nice)
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            del item
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # delivered to whoever waits on the future
                future.set_exception(exc)
            # Hold nothing of a finished call while waiting for the next one. A bound method or an
            # argument may own tensors (a restore's read buffers); if this idle thread held the last
            # reference when the interpreter exits, it would free them as its frame is torn down,
            # inside torch's deallocator, where taking the GIL back during finalisation ends the
            # thread with a forced unwind through a noexcept destructor: "terminate called without
            # an active exception", one exit in about 25 after a load_latest (gdb showed it).
            del future, fn, args

    def shutdown(self) -> None:
        """Let the threads finish the queued calls and exit (does not wait for them)."""
        for _ in self._threads:
            self._queue.put(None)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
