"""No fork while one of spotguard's threads is inside torch: a forked child must not inherit a held lock.

A forked child holds only the thread that forked. A lock another thread held at the instant of
``fork()`` stays held in the child for ever, and the child hangs the first time it takes it.
spotguard's background threads run torch code: the preparation of the staging buffers that a start
begins, the persist of a periodic save. Torch code takes torch's own mutexes; the dispatcher's
operator table, for one, is locked on each operator's first call in a process.

A loader forks its workers while such a thread runs. A fresh start prepares its buffers just as
the first epoch's workers are forked. Seen: a worker stuck on its first sample in
``at::_ops::select_int::call`` (``__lll_lock_wait_private``), its main process waiting for the
batch for ever. That happened 3 times in about 120 runs of a two-worker job on a loaded 2-core
machine, always the second worker of the first epoch. It is not CPython's gh-112275: any Python,
any start method that forks.

So each piece of torch work a spotguard thread does runs inside :func:`torch_work`. A fork of the
process waits until no piece runs (``os.register_at_fork(before=)``: a loader's workers, a
``multiprocessing`` pool, a plain ``os.fork``), and new pieces wait until the fork is done. The
pieces are short (a buffer made, 64 MiB touched, one tensor's bytes taken, an exchange between
ranks launched: not its wait for the other ranks), so a fork waits milliseconds. One is long: an
emergency save, a stop's last act, is one piece from its snapshot to its commit (its writer threads
copy too; a notice between steps saves in another thread while the loop may be starting workers). It goes on anyway after :data:`WAIT_S`, and says so once: a piece that
long would be a bug of ours, and a fork must never wait on it for ever. A fork from inside a piece
(not done by spotguard) does not wait for itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

__all__ = ["torch_work", "in_torch_work", "WAIT_S"]

log = logging.getLogger("spotguard")

WAIT_S = 5.0
"""The longest a fork waits for the pieces running in spotguard's threads."""

_cond = threading.Condition(threading.Lock())
_inside = 0
"""Pieces running now, in every thread."""
_forking = 0
"""Forks waiting or under way (another thread may fork at the same time)."""
_local = threading.local()
_warned = False


@contextlib.contextmanager
def torch_work() -> Iterator[None]:
    """Run the ``with`` body as one piece of torch work no fork may cut through (re-entrant)."""
    global _inside
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        with _cond:
            while _forking:
                _cond.wait()
            _inside += 1
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            with _cond:
                _inside = max(0, _inside - 1)
                if not _inside:
                    _cond.notify_all()


def in_torch_work(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as one piece of torch work (for a throttle's ``run``)."""
    with torch_work():
        return fn(*args)


def _before_fork() -> None:
    global _forking, _warned
    own = 1 if getattr(_local, "depth", 0) else 0
    started = time.monotonic()
    with _cond:
        _forking += 1
        while _inside > own:
            left = started + WAIT_S - time.monotonic()
            if left <= 0:
                break
            _cond.wait(left)
        late = _inside > own
    if late and not _warned:
        _warned = True
        log.warning("a fork went on after %.1f s with a spotguard thread still inside torch (%d piece(s)): "
                    "the child may hang on a lock that thread held", time.monotonic() - started, _inside - own)


def _after_in_parent() -> None:
    global _forking
    with _cond:
        _forking = max(0, _forking - 1)
        _cond.notify_all()


def _after_in_child() -> None:
    """Only the forking thread is left: a fresh condition (the parent's may have waiters that are
    gone), no fork under way, and only the forking thread's own piece running, if it was in one."""
    global _cond, _inside, _forking
    _cond = threading.Condition(threading.Lock())
    _inside, _forking = (1 if getattr(_local, "depth", 0) else 0), 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent,
                        after_in_child=_after_in_child)
