"""Which start method loader workers can use safely: CPython's fork deadlock gh-112275.

On CPython 3.10 before 3.10.15 and 3.11 before 3.11.10, a child process forked while another
thread holds the interpreter's thread-list lock (``HEAD_LOCK``) hangs for ever in
``PyOS_AfterFork_Child`` → ``_PyThreadState_DeleteExcept``, before any of its own code runs: the
lock is re-initialised only after that call (3.12 and later re-initialise it first, 3.13 takes it
around ``fork()``). A DataLoader worker forked then never starts; the main process waits for its
first batch.

Which threads hold that lock at the instant of ``fork()``? The forking thread holds the GIL, and a
Python thread takes the lock only while holding the GIL (creating or deleting its thread state), so
spotguard's own threads (guard, watchdogs, checkpoint preparation and persistence, all Python
threads) cannot be mid-way there: measured on 3.11.7, 0 hung children in 2,000 forks while Python
threads started, ended and waited continuously. A native thread that attaches to the interpreter
(``PyGILState_Ensure``: C++ code calling back into Python, pybind11's ``gil_scoped_acquire``, ctypes
callbacks) takes it *without* the GIL, and does: 13 hung children in 4,500 forks while native threads
ran a callback each. Parking spotguard's threads around ``fork()`` (``os.register_at_fork``) would
therefore not avoid it, and nothing in Python can park torch's or a library's native threads. What
avoids it is not forking from a process with other threads: :func:`worker_context` gives
``"forkserver"`` (workers are forked from a single-threaded server process) on an affected
interpreter when threads are alive, and None (torch's default, fork on Linux) otherwise.

A plain torch ``DataLoader`` (or any ``multiprocessing`` fork) cannot be switched from outside, but
it can be told: importing spotguard registers an ``os.register_at_fork`` hook that warns once, at
the first ``os.fork()`` of a process with other Python threads (spotguard's, say) on an affected
interpreter, naming the fix.
(``subprocess`` does not call the hook: its fork is followed by ``exec`` at once, in C.)

A forkserver's workers import the main script (as ``__mp_main__``), like ``spawn``: a script whose
training runs at import would run again there. It is used only when the main module's top level
only defines things (imports, functions, classes, assignments, an ``if __name__ == "__main__":``
block); otherwise the workers are forked and one warning says why and how to fix it.

Cost: the server is one more process, started once (:func:`start_forkserver`, when the loader is
built, so that it imports torch while the job sets up). Python 3.11's server does not preload
``__main__`` as it means to (it looks for the main path under the wrong key), so every worker would
import torch and everything the main script imports afresh (5-9 s each on a loaded 2-core machine):
the server preloads the modules the main script holds (:func:`main_modules`), torch, spotguard's
loader and the dataset's module. Starting two workers then took about as long as forking them
(0.09-0.12 s against 0.12-0.14 s; 0.2-0.3 s more under heavy load), although each start pickles the
dataset to each worker, which also runs the script's top level again (benchmarks/README.md).

**SIGTERM.** The server is a child of the rank, in its process group: torchrun's ``os.killpg``
(Kubernetes, ``docker stop``), Ctrl-C in a terminal and ``scancel`` reach it too. Had it died of
it, its workers (whose parent it is) would see their parent gone and end, and the rank would die of
"DataLoader worker exited unexpectedly" before its stop saved anything. So the server spotguard
starts ignores SIGTERM (it already ignores SIGINT) and still exits with the rank (its alive pipe
closes). The processes it forks begin with both ignored: a loader's workers (whose
``worker_init_fn`` is :func:`spotguard.data.ignore_stop_signals`') keep ignoring them, even one that
a stop signal reaches while it starts; every other child gets the defaults back just before its
target runs (:func:`_serve_through_stop_signals`).
"""

from __future__ import annotations

import ast
import functools
import warnings
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import types
from collections.abc import Iterable
from typing import Any

__all__ = ["deadlocks_at_fork", "threads_alive", "main_import_problem", "worker_context", "fork_warning",
           "start_forkserver", "main_modules", "fork_warned"]

FIXED_IN = {(3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}
"""The first release of each affected branch with the fix (backports merged September 2024)."""


def deadlocks_at_fork(version: tuple[int, ...] = tuple(sys.version_info[:3]),
                      implementation: str = sys.implementation.name) -> bool:
    """Whether this interpreter has gh-112275 (a forked child can hang before it runs any code)."""
    if implementation != "cpython" or tuple(version[:2]) >= (3, 12):
        return False
    return tuple(version[:3]) < FIXED_IN.get(tuple(version[:2]), (3, 10, 15))


def threads_alive() -> int:
    """Threads of this process, native ones included (torch's, a library's), not only Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def main_import_problem(path: str | None = None) -> str | None:
    """Why a forkserver or spawn child must not import the main module (or the script at ``path``),
    or None when it may: its top level only defines things (see the module docstring)."""
    path = path or getattr(sys.modules.get("__main__"), "__file__", None)
    if not path:
        return "the main module has no file (an interactive session or python -c)"
    return _script_problem(path)


@functools.lru_cache(maxsize=8)
def _script_problem(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"cannot read the main module {path} ({exc})"
    for node in tree.body:
        if not _inert(node):
            return (f"{path} line {node.lineno} runs code at import (a forkserver would run it again): "
                    "put it under `if __name__ == \"__main__\":`")
    return None


def _inert(node: ast.stmt) -> bool:
    """A top-level statement that only defines something when the module is imported."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                         ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Pass)):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)  # a docstring
    if isinstance(node, ast.If):
        return _is_main_guard(node.test) or all(map(_inert, node.body + node.orelse))
    if isinstance(node, ast.Try):
        return all(map(_inert, node.body + node.orelse + node.finalbody
                       + [stmt for handler in node.handlers for stmt in handler.body]))
    return False


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def worker_context() -> tuple[str | None, str | None]:
    """``(context, problem)`` for loader workers started now: ``("forkserver", None)`` where forking
    could deadlock and a forkserver can run; ``(None, problem)`` where it could deadlock but a
    forkserver cannot (``problem`` says why); ``(None, None)`` where forking is safe."""
    if not deadlocks_at_fork() or threads_alive() <= 1:
        return None, None
    problem = main_import_problem()
    return (None, problem) if problem else ("forkserver", None)


def main_modules() -> list[str]:
    """The modules the main script imported at its top level (its module globals, and the modules of
    the classes and functions it imported): what each forkserver worker imports again."""
    names = []
    for value in list(vars(sys.modules.get("__main__", types)).values()):
        if isinstance(value, types.ModuleType):
            names.append(value.__name__)
        elif isinstance(value, (type, types.FunctionType)):
            names.append(value.__module__)
    return [n for n in dict.fromkeys(names) if n not in ("__main__", "__mp_main__", "builtins")]


def start_forkserver(modules: Iterable[str]) -> None:
    """Start the forkserver now, unless running, preloading ``modules`` (see the module docstring:
    cost); returns at once, the server imports them in the background."""
    server = multiprocessing.forkserver._forkserver
    preload = list(getattr(server, "_preload_modules", None) or ["__main__"])
    multiprocessing.set_forkserver_preload(list(dict.fromkeys([*preload, *modules])))
    multiprocessing.forkserver.ensure_running()


_warned = False


def fork_warned() -> None:
    """A warning about this process's forks was given (by a loader): the hook says nothing more."""
    global _warned
    _warned = True


def _before_fork() -> None:
    """``os.register_at_fork(before=)``: the one warning of a fork whose child can hang."""
    if _warned or not deadlocks_at_fork() or threading.active_count() <= 1:
        return  # Python threads counted: a forkserver's own native ones (OpenBLAS's) never attach
    fork_warned()
    fixed = ".".join(map(str, FIXED_IN.get(tuple(sys.version_info[:2]), (3, 12, 0))))
    try:
        warnings.warn(f"this process forks with {threads_alive()} threads on CPython "
                      f"{'.'.join(map(str, sys.version_info[:3]))}, where the child can hang for ever "
                      f"before it starts (CPython gh-112275, fixed in {fixed}); torch's DataLoader and "
                      "multiprocessing fork by default. Fix: DataLoader(..., multiprocessing_context="
                      "'forkserver') with the script's training under `if __name__ == \"__main__\":`, "
                      f"spotguard.DataLoader (which does that itself), or Python >= {fixed}",
                      RuntimeWarning, stacklevel=2)
    except Exception:  # noqa: BLE001 - warnings made errors must not fail the fork
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)


def _in_forkserver() -> bool:
    """Whether this import runs in a forkserver's preload (``multiprocessing.forkserver.main``
    is on the stack): then the server outlives a SIGTERM to the rank's group (module docstring)."""
    server = sys.modules.get("multiprocessing.forkserver")
    main = getattr(server, "main", None)
    frame = sys._getframe(1)
    while frame is not None and main is not None:
        if frame.f_code is main.__code__:
            return True
        frame = frame.f_back
    return False


def _kept_worker(proc: object) -> bool:
    """Whether ``proc`` (a child's process object) is a loader worker whose ``worker_init_fn`` is
    spotguard's (:func:`spotguard.data.ignore_stop_signals`), which ignores the stop signals for good."""
    return any(isinstance(arg, functools.partial) and getattr(arg.func, "__module__", None) == "spotguard.data"
               and getattr(arg.func, "__name__", None) == "_worker_init" for arg in getattr(proc, "_args", ()))


def _serve_through_stop_signals() -> None:
    """In the forkserver: ignore SIGTERM and SIGINT (the server saves SIGINT's disposition now as its
    children's), so that a child begins with both ignored. A stop signal that reaches a loader worker
    while it starts (unpickling its dataset, importing: seconds under load, every epoch without
    persistent workers) is then dropped instead of killing it before its ``worker_init_fn`` ignores
    it. Just before a child's target runs, every child but such a worker gets both defaults back, so
    a ``Process`` or a ``Pool``'s worker still ends at ``terminate()``."""
    from multiprocessing import process

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    bootstrap = process.BaseProcess._bootstrap

    def _bootstrap(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _kept_worker(self):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return bootstrap(self, *args, **kwargs)
    process.BaseProcess._bootstrap = _bootstrap  # type: ignore[method-assign]


if _in_forkserver():
    _serve_through_stop_signals()


def fork_warning(problem: str) -> str:
    """The one warning of a loader that forks workers where that can deadlock."""
    version = ".".join(map(str, sys.version_info[:3]))
    fixed = ".".join(map(str, FIXED_IN.get(tuple(sys.version_info[:2]), (3, 12, 0))))
    return (f"DataLoader workers are forked from a process with {threads_alive()} threads on CPython "
            f"{version}, where a forked worker can hang for ever before it starts (CPython gh-112275, "
            f"fixed in {fixed}); a forkserver was not used because {problem}. Fix: keep the script's "
            "training under `if __name__ == \"__main__\":` and the dataset and worker_init_fn at "
            "module level (picklable), pass multiprocessing_context='fork' to keep forking knowingly, "
            f"or use Python >= {fixed}")
