"""Exact data position for the Lightning callback: the train loaders' randomness and epoch offset.

A plain ``DataLoader(shuffle=True)`` draws from the *global* torch RNG twice per epoch: its
iterator's base seed (worker seeds) when the iterator is created, and the ``RandomSampler``'s
permutation seed at the first batch. A resumed process reaches those draws at another point of the
global stream than the uninterrupted run did, so every later dropout mask differs; and Lightning
restarts a plain loader's epoch from its first batch. :class:`DataPosition` removes both causes:

* each train ``DataLoader`` gets two ``torch.Generator`` of its own, one as the
  ``RandomSampler``'s ``generator`` (the permutation), one as ``loader.generator`` (the worker base
  seed, drawn only when an iterator is created, which persistent workers do once), both reseeded
  at every epoch start from ``(seed, loader, epoch)``: the permutation is a function of the epoch
  alone and the global stream sees no draw from the loader at all;
* the position (epoch, batches consumed) is saved with each checkpoint; on resume the first
  iterator skips the consumed batches at the index level (``BatchSampler.sampler`` is wrapped), so
  no skipped sample is loaded.

``seed`` is ``torch.initial_seed()`` at the first fit (``seed_everything`` sets it), then the
checkpoint's. The loaders are taken over in Lightning's ``FitLoop.setup_data``, right after they
are built and before their first iterator exists (the loop's ``_load_combined_loader_states`` is
wrapped on the instance). Each owned loader is made ``_Stateful`` for Lightning, so Lightning no
longer warns that it is not resumable.

Not exact, and warned about once at the first save, naming the fix: a loader that is not a
``DataLoader`` with a ``BatchSampler`` (an ``IterableDataset``, a custom ``batch_sampler``, several
train loaders at once) unless it is stateful itself (torchdata's ``StatefulDataLoader``), and a
dataset whose ``__getitem__`` draws from the global torch/NumPy/Python RNG (random augmentation):
its draws are not replayed on resume.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import sys
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from spotguard.data import ignore_stop_signals

log = logging.getLogger(__name__)

_HOOK = "_load_combined_loader_states"


class _SkipSampler(Sampler):
    """The wrapped sampler with the first ``skip`` indices of its next iteration dropped."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.skip = inner, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.inner), skip, None)

    def __getattr__(self, name: str) -> Any:  # set_epoch, generator, ... of the wrapped sampler
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class DataPosition:
    """One stateful entry of the spotguard checkpoint; see the module docstring."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.seed = torch.initial_seed()
        self.epoch = self.batches = 0
        self._resume: tuple[int, int] | None = None
        self._loaders: list[tuple[DataLoader, torch.Generator, torch.Generator]] = []
        self._problems: list[str] = []
        self._checked = False

    # ------------------------------------------------------------------ checkpoint entry

    def state_dict(self) -> dict[str, int]:
        if not self._checked:
            self._checked = True
            self._warn_inexact()
        return {"seed": self.seed, "epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._resume = (int(state["epoch"]), int(state["batches"]))

    # ------------------------------------------------------------------ Lightning events

    def install(self) -> None:
        """Take over the train loaders whenever the fit loop (re)builds them."""
        loop = self.trainer.fit_loop
        original = getattr(type(loop), _HOOK, None)
        if original is None:
            self._problems.append(f"this Lightning has no FitLoop.{_HOOK}: the train loaders are "
                                  "left as they are (pin lightning to a tested 2.x)")
            return

        def hook() -> None:
            self._own(loop._combined_loader)
            original(loop)

        setattr(loop, _HOOK, hook)

    def uninstall(self) -> None:
        vars(self.trainer.fit_loop).pop(_HOOK, None)

    def epoch_started(self) -> None:
        """``on_train_epoch_start``: a new epoch's iterator is about to be made; reseed for it."""
        epoch = self.trainer.fit_loop.epoch_progress.current.processed
        if epoch != self.epoch:
            self.epoch, self.batches = epoch, 0
            self._reseed()

    def batch_done(self) -> None:
        self.batches += 1

    # ------------------------------------------------------------------ internals

    def _own(self, combined: Any) -> None:
        loaders = list(getattr(combined, "flattened", []))
        epoch, skip = self._resume or (self.trainer.current_epoch, 0)
        self._resume = None
        if skip and len(loaders) == 1 and skip >= _length(loaders[0]):
            epoch, skip = epoch + 1, 0  # saved after the epoch's last batch: the next one starts
        if skip and len(loaders) != 1:
            self._problem("several train loaders: the position inside the epoch is not restored; "
                          "save at epoch ends or use one loader")
            skip = 0
        self.epoch, self.batches = epoch, skip
        self._loaders = [owned for dl in loaders if (owned := self._own_one(dl, skip))]
        self._reseed()
        for dl in loaders:  # before Lightning's first iterator, which it makes before its set_epoch
            _set_epoch(dl, epoch)

    def _own_one(self, dl: Any, skip: int) -> tuple[DataLoader, torch.Generator,
                                                    torch.Generator] | None:
        if isinstance(dl, DataLoader):  # workers outlive a SIGTERM to the rank's group; same draws
            ignore_stop_signals(dl)
        if hasattr(dl, "state_dict") and hasattr(dl, "load_state_dict"):
            return None  # stateful (StatefulDataLoader): Lightning saves and restores it
        if not isinstance(dl, DataLoader) or not isinstance(dl.batch_sampler, BatchSampler):
            self._problem(f"the train loader {type(dl).__name__} is not a DataLoader with a "
                          "BatchSampler: its order and position are not restored; use "
                          "DataLoader(dataset, batch_size=..., shuffle=True) or torchdata's "
                          "StatefulDataLoader")
            return None
        order, workers = torch.Generator(), torch.Generator()
        dl.generator = workers
        if isinstance(dl.sampler, RandomSampler):
            dl.sampler.generator = order
        batches = dl.batch_sampler
        if not isinstance(batches.sampler, _SkipSampler):
            batches.sampler = _SkipSampler(batches.sampler)
        batches.sampler.skip = skip * batches.batch_size
        dl.state_dict = lambda: {"epoch": self.epoch, "batches": self.batches}  # Lightning: stateful
        dl.load_state_dict = lambda state: None  # restored from spotguard's own entry
        self._probe_dataset(dl)
        return dl, order, workers

    def _reseed(self) -> None:
        for index, (_, order, workers) in enumerate(self._loaders):
            order.manual_seed(_derive(self.seed, index, self.epoch, "order"))
            workers.manual_seed(_derive(self.seed, index, self.epoch, "workers"))

    def _probe_dataset(self, dl: DataLoader) -> None:
        """Fetch one sample and see whether it drew from a global RNG (random augmentation)."""
        dataset = dl.dataset
        if not hasattr(dataset, "__getitem__") or not _length(dataset):
            return
        before = _global_states()
        try:
            dataset[0]
        except Exception:  # noqa: BLE001 - a probe only; the loader reports real errors itself
            return
        finally:
            after = _global_states()
            _set_global_states(before)
        if not all(_same(a, b) for a, b in zip(before, after)):
            self._problem("the training dataset draws from the global torch/NumPy/Python RNG in "
                          "__getitem__ (random augmentation): those draws are not replayed on "
                          "resume; draw from a generator seeded by (seed, epoch, index) instead")

    def _problem(self, text: str) -> None:
        if text not in self._problems:
            self._problems.append(text)

    def _warn_inexact(self) -> None:
        for text in self._problems:
            log.warning("resume will not be bit-identical: %s", text)


def _set_epoch(dl: Any, epoch: int) -> None:
    """Tell the loader's samplers (a ``DistributedSampler`` under DDP) the epoch its next iterator
    is for. Lightning makes the resumed launch's first iterator in ``setup_data``, before it calls
    ``set_epoch``; a loader with workers draws its order at once (its prefetch), so it would draw
    the sampler's initial epoch's order instead of the resumed one's."""
    batches = getattr(dl, "batch_sampler", None)
    for sampler in {id(s): s for s in (getattr(dl, "sampler", None), getattr(batches, "sampler", None))}.values():
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def _derive(seed: int, index: int, epoch: int, purpose: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{index}/{epoch}/{purpose}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _length(obj: Any) -> int:
    try:
        return len(obj)
    except TypeError:
        return 0


def _global_states() -> tuple[Any, ...]:
    numpy = sys.modules.get("numpy")
    return (torch.get_rng_state(), random.getstate(),
            numpy.random.get_state() if numpy is not None else None)


def _set_global_states(states: tuple[Any, ...]) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    if states[2] is not None:
        sys.modules["numpy"].random.set_state(states[2])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and a and hasattr(a[1], "shape"):  # NumPy's (name, keys, pos, ...)
        return a[0] == b[0] and (a[1] == b[1]).all() and a[2:] == b[2:]
    return a == b
