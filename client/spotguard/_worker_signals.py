"""Every torch DataLoader worker forked from a guarded process outlives the stop signals.

torchrun passes SIGTERM on with ``os.killpg`` to each rank's process group (so do Ctrl-C in a
terminal, ``scancel`` and systemd's ``KillMode=control-group``), and the group holds the rank's
loader workers. A worker that dies of it makes the rank's next batch raise "DataLoader worker
exited unexpectedly" before the step boundary where the stop saves. ``spotguard.DataLoader`` and
:func:`spotguard.ignore_stop_signals` keep their own workers through it; this covers the loaders
nobody handed to spotguard: a plain ``DataLoader`` in the user's loop, a validation or evaluation
loader a framework builds, a loader made inside a library.

torch calls ``signal_handling._set_worker_signal_handlers()`` first thing in every worker (it
installs its SIGBUS/SIGSEGV handlers there). :func:`protect` wraps it, once per process, when a
:class:`~spotguard.Guard` installs its signal handlers: in a worker whose main process had a live,
signal-handling Guard when it forked it, the wrapper then also ignores SIGTERM and SIGINT and ends
the worker when its main process is gone (:func:`keep_through_stop_signals`). At exit, the
daemonic children still alive get SIGTERM and, a second later, SIGKILL, before ``multiprocessing``
would SIGTERM them and join them for ever. Workers started with ``spawn`` or ``forkserver`` begin
in a fresh interpreter without the wrapper: for those, ``spotguard.DataLoader`` or
``ignore_stop_signals(loader)``, as the docs say.

A stop signal can also come while a worker starts (each epoch without persistent workers),
between its fork and torch's hook. The Guard's at-fork hook tells :func:`forked` in every forked
child, first; a child forked from torch's loader code (:func:`_starts_loader_worker`: the forking
thread's stack, which the child goes on from, passes through ``torch.utils.data.dataloader``) of a
guarded process blocks SIGTERM and SIGINT at once. One that comes meanwhile stays pending, and the
kernel drops it when :func:`keep_through_stop_signals` sets SIG_IGN, then unblocks them. (One
caught by the Guard's inherited handler before that runs in the child, harmlessly: Python skips it
once the handler is restored, or the child's copy of the Guard notes it.)

Every forked child then drops the Guard's handlers it inherited (the same at-fork hook): a
child that is not a loader worker (a ``multiprocessing.Pool``'s, whose ``terminate()`` sends
SIGTERM; a helper process) gets the handlers from before the Guard back, and dies of SIGTERM as it
would without spotguard, instead of noting a "notice" no thread of its own will ever read.

torch's SIGCHLD handler raises a worker's death in the main thread wherever it is;
:func:`worker_errors_deferred` holds it while a stop runs (its save, its messages, its exit).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

log = logging.getLogger("spotguard")

_MODULE = "torch.utils.data._utils.signal_handling"
_parent_guarded = False
"""In a forked child: whether the process it was forked from had a signal-handling Guard (set by
:func:`forked`, from the Guard's at-fork hook)."""


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_STACK_DEPTH = 16
"""Frames of the forking thread looked at: torch's loader iterator is 6 or 7 up from :func:`forked`."""


def forked(guarded: bool) -> None:
    """Called in every forked child, first: remember whether its parent was guarded; in a loader
    worker of a guarded process, hold SIGTERM and SIGINT until the worker ignores them."""
    global _parent_guarded
    _parent_guarded = guarded
    if guarded and _wrapped() and _starts_loader_worker():
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)


def _wrapped() -> bool:
    """Whether torch's worker start hook is :func:`protect`'s wrapper (it unblocks them)."""
    hook = getattr(sys.modules.get(_MODULE), "_set_worker_signal_handlers", None)
    return getattr(hook, "__spotguard__", False)


def _starts_loader_worker() -> bool:
    """In a forked child: whether torch's loader forked it, as a worker. The child goes on from
    ``os.fork()`` in ``multiprocessing``'s Popen, under the iterator that starts the workers."""
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == "torch.utils.data.dataloader":
            return True
        frame = frame.f_back
    return False


def protect() -> None:
    """Wrap torch's worker start hook (once; a no-op without torch loaded)."""
    module = sys.modules.get(_MODULE)
    if module is None and "torch" in sys.modules:
        import importlib
        module = importlib.import_module(_MODULE)
    original = getattr(module, "_set_worker_signal_handlers", None)
    if original is None or getattr(original, "__spotguard__", False):
        if module is not None and original is None:
            log.debug("torch has no %s._set_worker_signal_handlers: plain loaders' workers keep "
                      "SIGTERM's default (use spotguard.ignore_stop_signals)", _MODULE)
        return

    def set_worker_signal_handlers(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if _parent_guarded:
            keep_through_stop_signals()
        return result

    set_worker_signal_handlers.__spotguard__ = True  # type: ignore[attr-defined]
    set_worker_signal_handlers.__wrapped__ = original  # type: ignore[attr-defined]
    module._set_worker_signal_handlers = set_worker_signal_handlers
    atexit.register(_end_loader_workers)
    os.register_at_fork(after_in_parent=_newest_at_exit)


def _newest_at_exit() -> None:
    """After each fork, in the parent: make :func:`_end_loader_workers` the newest exit handler
    again, so it runs before ``multiprocessing``'s, registered when its first child started."""
    atexit.unregister(_end_loader_workers)
    atexit.register(_end_loader_workers)


def _end_loader_workers() -> None:
    """At exit, before ``multiprocessing``'s own handler: end the daemonic children still alive
    (loader workers of an iterator still referenced then: a framework's, a generator's) as it
    would, with SIGTERM, then SIGKILL those still there after a second. Its handler joins them
    without a timeout, and a loader worker of a guarded process ignores SIGTERM: the process would
    hang at exit. A worker holds nothing to flush."""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if children and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's would raise for each: we are leaving
    for child in children:
        child.terminate()
    deadline = time.monotonic() + _EXIT_GRACE
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(1.0)


_EXIT_GRACE = 1.0
"""Seconds the daemonic children get at exit between SIGTERM and SIGKILL."""


def keep_through_stop_signals() -> None:
    """In a loader worker: ignore SIGTERM and SIGINT (the main process decides when workers stop)
    and exit once the main process is gone, however it died."""
    global _watching
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # held since the fork: now dropped
    parent = multiprocessing.parent_process()
    if parent is not None and _watching != os.getpid():  # torch's hook and the loader's init both call this
        _watching = os.getpid()
        threading.Thread(target=_exit_with, args=(parent,), name="spotguard-worker-orphan", daemon=True).start()


_watching = 0
"""The pid of the process whose orphan watch runs (a forked child inherits the value, not the thread)."""


def _exit_with(parent: Any) -> None:
    """End this worker once its main process is gone, however it died.

    torch's own check compares ``os.getppid()`` with the parent pid it reads when its loop starts,
    after the init functions: a main process SIGKILLed while its workers start (a preemption at
    start-up) leaves them orphaned before that read, and they then wait on their queue forever,
    holding their memory. The parent's sentinel is a pipe that closes when it dies, whatever the
    start method."""
    parent.join()
    os._exit(0)


@contextlib.contextmanager
def worker_errors_deferred(*, for_good: bool | Callable[[], bool] = False) -> Iterator[None]:
    """torch's SIGCHLD handler raises "DataLoader worker (pid N) is killed by signal" in the main
    thread wherever it is at the instant: inside a stop's save, that aborts the save of a step
    which is complete (the dead workers only matter to batches still to come). While the stop
    saves, SIGCHLD takes its default (the loader's own checks still see the dead workers at its
    next batch); ``for_good`` (or what it returns, asked at the end): the stop ends the process, so
    the handler is not put back (torch's next loader iterator would install it again)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGCHLD)
    if not callable(previous):  # SIG_DFL, SIG_IGN, or installed from C: nothing of torch's to hold
        yield
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        yield
    finally:
        if not (for_good() if callable(for_good) else for_good):
            signal.signal(signal.SIGCHLD, previous)
        elif (torch_signals := sys.modules.get(_MODULE)) is not None:
            torch_signals._SIGCHLD_handler_set = False  # a process that goes on anyway (an embedding
            # program caught the SystemExit): torch's next loader iterator installs its handler again
