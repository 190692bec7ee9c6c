"""A torch ``DataLoader`` whose every random draw is a function of the run's position, so a resumed run
replays an uninterrupted one bit for bit.

::

    loader = spotguard.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2, seed=0)
    run = spotguard.Run("checkpoints", model=model, optimizer=opt, scheduler=sched, loader=loader)

Why a plain ``torch.utils.data.DataLoader`` cannot resume exactly, and what this one does instead:

* **The iterator's seed.** Each ``iter(loader)`` draws a base seed from ``loader.generator``, and
  from the *global* torch RNG when that is ``None``. A resumed run creates its iterator at another
  point of the global stream than the uninterrupted one, so every later dropout mask differs. This
  loader owns a private generator, reseeded from (seed, rank, epoch, pass) before each iterator.
* **The workers' RNG streams.** A worker seeds torch, NumPy and ``random`` once, then draws its
  samples' augmentations in sequence; a resumed epoch starts fresh workers on other samples. This
  loader seeds the three generators *per sample*, from (seed, rank, epoch, pass, position), in the
  worker that loads it (in the main process with ``num_workers=0``, where the global generators are
  put back afterwards, so augmentations never shift the training step's draws). A sample's
  augmentation is then the same with any number of workers, any prefetch, and after any resume.
* **The position.** The loop's position is the samples *handed to it*, not the samples the workers
  prefetched: the loader advances its :class:`~spotguard.ResumableSampler` by each batch it returns,
  so the loop needs no ``sampler.advance`` call.
* **SIGTERM and SIGINT.** torchrun passes SIGTERM on with ``os.killpg`` to each rank's process
  group, workers included (so do Ctrl-C, ``scancel`` and systemd's ``KillMode=control-group``), and
  torch's loader raises "DataLoader worker exited unexpectedly" in the main process, before the
  step boundary where the stop saves, when a worker dies of it. This loader's workers ignore both
  signals (:func:`ignore_stop_signals`; the forkserver they may start from too, see
  :mod:`spotguard._fork`): the main process saves and stops them as usual, and they exit when it
  dies. Workers that die anyway while the process is stopping (they were starting when the signal
  came) are started again at the same position: the loop gets the batch it was waiting for, and the
  rank reaches the boundary where every rank stops.
* **Worker start.** On CPython 3.10 before 3.10.15 and 3.11 before 3.11.10, a worker forked while
  the process has other threads can hang before it starts (CPython gh-112275): unless the loader
  was given a ``multiprocessing_context``, its workers then start from a ``forkserver`` (see
  :mod:`spotguard._fork`: when, why, and what it costs).
* **A worker that hangs.** :meth:`DataLoader.waiting_seconds` tells how long the loop has waited for
  the batch in progress; :class:`~spotguard.Run` ends a rank whose loader produced nothing for
  ``stall_timeout`` seconds while its workers are alive, naming the cause, instead of blaming a
  peer at ``peer_timeout``. A forced exit (any spotguard watchdog) SIGKILLs the workers first, so
  none is left behind, not even one that never started.
* **When the iterator is created.** ``iter(loader)`` starts nothing: workers, prefetch and the
  sampler start at the first ``next()``, and start over if a checkpoint was loaded since, so an
  iterator made before ``run.steps()`` loads the state still resumes at the saved position.

An ``IterableDataset`` (a stream) is supported with ``num_workers=0`` when it has ``state_dict`` and
``load_state_dict`` giving its position (items yielded so far): no worker prefetches, so the
stream's position is what the loop consumed, and its augmentations draw from the main process's
generators, which the checkpoint holds. A stream read by workers needs torchdata's
``StatefulDataLoader`` (with :class:`~spotguard.LoaderState`); this loader refuses that case.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import random
import signal
import sys
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.utils.data as tud

from spotguard import _fork, _watchdog
from spotguard._worker_signals import keep_through_stop_signals
from spotguard.guard import stop_pending
from spotguard.sampler import ResumableSampler, SamplerStateError

__all__ = ["DataLoader", "ignore_stop_signals", "sample_seed", "stop_workers", "kill_workers"]

log = logging.getLogger(__name__)
_MASK64 = (1 << 64) - 1
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""The torch iterators of every spotguard.DataLoader, for :func:`stop_workers`."""


def stop_workers() -> None:
    """Shut down the worker processes of every spotguard.DataLoader iterator still alive.

    An ``atexit`` handler, registered when the first iterator starts (so it runs before torch's
    and ``multiprocessing``'s, registered earlier): an iterator still referenced at exit (a global,
    a generator in one) is not shut down by torch once its exit flag is set, and ``multiprocessing``
    then terminates the workers, which ignore SIGTERM, and joins them without a timeout: the
    process would hang at exit (until the forced-exit watchdog, after a stop). Torch's own
    shutdown tells them to stop."""
    for it in list(_LIVE):
        shutdown = getattr(it, "_shutdown_workers", None)  # only the multiprocessing iterator has it
        if shutdown is not None:
            shutdown()


def kill_workers() -> None:
    """SIGKILL the worker processes of every live iterator: a forced exit's last act (see
    :func:`spotguard._watchdog.on_forced_exit`). ``os._exit`` skips torch's shutdown, and a worker
    that is hung, or never started (the fork deadlock), would outlive the process. No lock, no I/O
    but the signals: it runs in a watchdog thread while the main thread may hold anything."""
    for it in list(_LIVE):
        for worker in list(getattr(it, "_workers", ())):
            try:
                if worker.pid:
                    os.kill(worker.pid, signal.SIGKILL)
            except (OSError, AttributeError):
                pass


def sample_seed(*parts: int) -> int:
    """A 63-bit seed mixed from ``parts`` (splitmix64 per part): close inputs give unrelated seeds."""
    x = 0x9E3779B97F4A7C15
    for part in parts:
        x = (x ^ (int(part) & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x >> 1


@contextmanager
def _global_rngs_kept() -> Iterator[None]:
    """Put torch's CPU, NumPy's and Python's global generators back as they were on exit."""
    np = sys.modules.get("numpy")
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state() if np else None)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        if np is not None:
            np.random.set_state(saved[2])


def _seed_globals(seed: int) -> None:
    """Seed the generators a dataset's augmentation draws from; CUDA's are left alone."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


class _Seeded(tud.Dataset):
    """The user's map-style dataset, fetched by keys ``(index, seed)``: each sample under its seed."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        with _global_rngs_kept():
            out = []
            for index, seed in keys:
                _seed_globals(seed)
                out.append(self.dataset[index])
            return out

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


class _Keys:
    """The sampler the torch loader sees: the ResumableSampler's indices, each with its seed.

    Attribute reads go to the ResumableSampler, so ``loader.sampler.set_epoch(e)`` works as usual.
    """

    def __init__(self, sampler: ResumableSampler) -> None:
        self.resumable = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        s = self.resumable
        indices = iter(s)  # begins (or resumes) a pass: position and passes are current after it
        base = sample_seed(s.seed, s.rank, s.epoch, s.passes)  # the per-sample part is one round
        return ((index, sample_seed(base, at)) for at, index in enumerate(indices, s.position))

    def __len__(self) -> int:
        return len(self.resumable)

    def __getattr__(self, name: str) -> Any:
        if name == "resumable":
            raise AttributeError(name)
        return getattr(self.resumable, name)


class DataLoader(tud.DataLoader):
    """``torch.utils.data.DataLoader`` with the same arguments, resumable bit-identically.

    Map-style datasets: ``sampler`` must be a :class:`~spotguard.ResumableSampler`, or left out,
    and one is built from ``shuffle`` and ``seed`` (and torch.distributed's rank and world size).
    ``batch_sampler`` and ``generator`` are not accepted: the loader owns both. ``loader.sampler``
    forwards to the ResumableSampler (``set_epoch``, ``epoch``...). Give the loader to
    :class:`~spotguard.Run` as ``loader=``; its :meth:`state_dict` is the sampler's (or the stream's).

    ``multiprocessing_context`` left out: chosen at each worker start (see :mod:`spotguard._fork`).
    ``stall_timeout``: seconds without a batch, its workers alive, after which :class:`~spotguard.Run`
    ends the rank as hung on its loader (None: ``min(300, peer_timeout / 2)``).
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: ResumableSampler | None = None, *, seed: int = 0, drop_last: bool = False,
                 stall_timeout: float | None = None, **kwargs: Any) -> None:
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, not {stall_timeout}")
        self.stall_timeout = stall_timeout
        self._context_given = kwargs.get("multiprocessing_context") is not None
        self._waiting_since: float | None = None
        for name in ("batch_sampler", "generator"):
            if kwargs.get(name) is not None:
                raise TypeError(f"spotguard.DataLoader owns its {name}; leave it out")
        kwargs.pop("batch_sampler", None), kwargs.pop("generator", None)
        self.seed = int(seed)
        kwargs["worker_init_fn"] = functools.partial(_worker_init, kwargs.get("worker_init_fn"))
        generator = torch.Generator().manual_seed(self.seed)
        if isinstance(dataset, tud.IterableDataset):
            self.stream, self.resumable = _check_stream(dataset, sampler, kwargs), None
            super().__init__(dataset, batch_size, drop_last=drop_last, generator=generator, **kwargs)
            return
        self.stream, self.resumable = None, _resumable(dataset, sampler, shuffle, self.seed)
        self.resumable._owner = self
        super().__init__(_Seeded(dataset), batch_size, sampler=_Keys(self.resumable),
                         drop_last=drop_last, generator=generator, **kwargs)
        if self.num_workers and not self._context_given and _fork.deadlocks_at_fork() \
                and _fork.main_import_problem() is None:  # it may be needed: start it, it takes seconds
            _fork.start_forkserver(self._preload())

    def _preload(self) -> list[str]:
        return _preload(getattr(self.dataset, "dataset", self.dataset))  # inside its _Seeded

    def __iter__(self) -> "_Batches":
        return _Batches(self)

    def _torch_iter(self) -> Iterator[Any]:
        """A fresh torch iterator (workers, prefetch), its base seed a function of the position."""
        s = self.resumable
        where = (s.rank, s.epoch, s.passes + (0 if s._resume_pending else 1)) if s else (0, 0, 0)
        self.generator.manual_seed(sample_seed(self.seed, *where))
        if not self.num_workers or self._context_given:
            return super().__iter__()
        context, problem = _fork.worker_context()
        self.multiprocessing_context = context
        if problem is not None and not self._warned_fork:
            self._warned_fork = True
            _fork.fork_warned()
            warnings.warn(_fork.fork_warning(problem), RuntimeWarning, stacklevel=3)
        if context is None:
            return super().__iter__()
        _fork.start_forkserver(self._preload())
        try:
            return super().__iter__()
        except Exception as exc:  # noqa: BLE001 - the dataset cannot travel to a forkserver: fork
            self.multiprocessing_context = None
            self._warned_fork = True
            _fork.fork_warned()
            warnings.warn(_fork.fork_warning(f"starting a worker from it failed: {exc!r}"),
                          RuntimeWarning, stacklevel=3)
            return super().__iter__()

    _warned_fork = False

    def waiting_seconds(self) -> float | None:
        """Seconds the loop has been waiting for the batch in progress; None when not waiting."""
        since = self._waiting_since
        return None if since is None else time.monotonic() - since

    def worker_pids(self) -> list[int]:
        """The pids of the workers of this loader's live iterators."""
        return [w.pid for it in list(_LIVE) if getattr(it, "_dataset", None) is self.dataset
                for w in list(getattr(it, "_workers", ())) if w.pid]

    def _handed_out(self) -> None:
        """One batch went to the loop: advance the sampler by the samples in it."""
        s = self.resumable
        if s is not None:
            s._advance(min(self.batch_size or 1, s.num_samples - s.position))

    def _restored(self) -> int:
        return self.resumable.restored if self.resumable is not None else self._stream_restored

    _stream_restored = 0

    def state_dict(self) -> dict[str, Any]:
        if self.resumable is not None:
            return {"sampler": self.resumable.state_dict()}
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.resumable is not None:
            self.resumable.load_state_dict(state["sampler"])
        else:
            self.stream.load_state_dict(state["stream"])
            self._stream_restored += 1


class _Batches:
    """``iter(loader)``: the torch iterator starts at the first ``next()``, and again after a load."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self._it, self._restored = loader, None, loader._restored()

    def __iter__(self) -> "_Batches":
        return self

    def __next__(self) -> Any:
        try:
            batch = self._next()
        except StopIteration:
            raise
        except Exception as exc:  # torch's "worker exited unexpectedly", or an EOFError mid-batch
            if not self._lost_to_stop(exc):
                raise
            batch = self._next()  # once more, from fresh workers, at the same position
        self.loader._handed_out()
        return batch

    def _lost_to_stop(self, exc: Exception) -> bool:
        """The workers died while the process is stopping (the signal reached them before they
        could ignore it: they were starting): start fresh ones at the same position, so this rank
        gets the very batch it was waiting for (each sample's draws are a function of its
        position), finishes the step and stops at the boundary with the other ranks."""
        s = self.loader.resumable
        if s is None or not stop_pending() or not (str(exc).startswith("DataLoader worker (pid")
                                                   or _worker_died(self._it)):
            return False
        log.warning("the loader's workers died while stopping (%s: %s): starting them again at the same "
                    "position", type(exc).__name__, exc)
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.loader._iterator = None  # persistent workers: torch would reset the dead iterator
        s._again()
        return True

    def _next(self) -> Any:
        if self._it is None or self._restored != self.loader._restored():
            self._restored = self.loader._restored()
            self._it = self.loader._torch_iter()
            if not _LIVE:
                atexit.unregister(stop_workers)  # registered again: newest, so it runs first
                atexit.register(stop_workers)
                _watchdog.on_forced_exit(kill_workers)
            _LIVE.add(self._it)
        self.loader._waiting_since = time.monotonic()
        try:
            return next(self._it)
        finally:
            self.loader._waiting_since = None

    def __len__(self) -> int:
        return len(self.loader)


def ignore_stop_signals(loader: Any) -> Any:
    """Make ``loader``'s worker processes ignore SIGTERM and SIGINT from its next iterator on, and
    exit when the main process is gone; returns ``loader``.

    Its ``worker_init_fn`` is chained (the user's runs after, with the same ``worker_id``); nothing
    is drawn from any generator, so the batches are the same. Workers already started (a live
    iterator, persistent workers) keep their handlers. For any torch ``DataLoader`` (a plain one,
    Lightning's or the Hugging Face ``Trainer``'s); ``spotguard.DataLoader`` does it itself. A loader
    started with ``spawn`` or ``forkserver`` needs its ``worker_init_fn`` picklable, as before; for
    ``forkserver``, the server is started here, preloading torch, the dataset's module and what the
    main script imported (found on ``sys.path`` from the working directory: Python 3.11's server is
    not given the script's), so that each epoch's workers do not import them again."""
    init = getattr(loader, "worker_init_fn", None)
    if isinstance(init, functools.partial) and init.func is _worker_init:
        return loader
    loader.worker_init_fn = functools.partial(_worker_init, init)
    context = getattr(loader, "multiprocessing_context", None)
    if context is not None and context.get_start_method() == "forkserver":
        # A server of spotguard's, unless one runs (SIGTERM kept off it), preloading what every
        # worker would import again: each epoch's workers start in 0.1 s instead of seconds.
        _fork.start_forkserver(_preload(getattr(loader, "dataset", None)))
    return loader


def _preload(dataset: Any) -> list[str]:
    """What a forkserver imports once for every worker: torch, this module, the dataset's, the
    main script's."""
    return ["torch", __name__, type(dataset).__module__, *_fork.main_modules()]


def _worker_died(it: Any, wait: float = 1.0) -> bool:
    """Whether a worker of torch iterator ``it`` is dead (one killed mid-batch can break the data
    pipe, an EOFError, a moment before it is reaped): asked for up to ``wait`` seconds."""
    workers = list(getattr(it, "_workers", ()))
    deadline = time.monotonic() + wait
    try:
        while workers:
            if any(not w.is_alive() for w in workers):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
    except RuntimeError as exc:  # torch's SIGCHLD handler: "DataLoader worker (pid N) is killed by ..."
        return str(exc).startswith("DataLoader worker (pid")
    return False


def _worker_init(user_init: Any, worker_id: int) -> None:
    """In each worker: ignore SIGTERM and SIGINT (the main process decides when workers stop), exit
    with the main process, then the user's init."""
    keep_through_stop_signals()
    if user_init is not None:
        user_init(worker_id)


def _resumable(dataset: Any, sampler: Any, shuffle: bool | None, seed: int) -> ResumableSampler:
    if sampler is None:
        return ResumableSampler(dataset, shuffle=bool(shuffle), seed=seed)
    if not isinstance(sampler, ResumableSampler):
        raise TypeError(f"spotguard.DataLoader needs a spotguard.ResumableSampler, got "
                        f"{type(sampler).__name__}")
    if shuffle:
        raise ValueError("give shuffle to the ResumableSampler, not to the loader")
    if sampler._owner is not None:
        raise SamplerStateError("this ResumableSampler already belongs to another spotguard.DataLoader")
    return sampler


def _check_stream(dataset: Any, sampler: Any, kwargs: dict[str, Any]) -> Any:
    if sampler is not None:
        raise ValueError("an IterableDataset takes no sampler")
    if kwargs.get("num_workers", 0):
        raise ValueError("spotguard.DataLoader reads an IterableDataset in the main process only "
                         "(num_workers=0): with workers, use torchdata's StatefulDataLoader and "
                         "spotguard.LoaderState")
    if not (callable(getattr(dataset, "state_dict", None))
            and callable(getattr(dataset, "load_state_dict", None))):
        raise TypeError(f"{type(dataset).__name__} is an IterableDataset without state_dict/"
                        "load_state_dict: a stream must know its position to resume")
    return dataset
