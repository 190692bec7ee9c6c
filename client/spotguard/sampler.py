"""Resume the data order mid-epoch: a sampler whose state is (epoch, samples consumed).

:class:`ResumableSampler` draws the same permutations and shards as ``DistributedSampler`` (seeded
by ``seed + epoch``, padded or trimmed to a multiple of the world size, rank ``r`` takes every
``world_size``-th index from ``r``), so it can replace one without changing the data order. A
resumed run, given the saved :meth:`~ResumableSampler.state_dict`, yields exactly the indices the
interrupted run had not yet trained on, in the same order.

Why the loop calls :meth:`~ResumableSampler.advance`: a DataLoader pulls indices ahead of the loop
(a whole batch at once, and ``prefetch_factor * num_workers`` batches with workers), so the number
of indices the sampler has *yielded* overstates what was trained on; a checkpoint that recorded it
would skip the prefetched samples on resume. The sampler therefore records the position *handed to
the loop*: after each step, the loop calls ``sampler.advance(n)`` with the number of samples that
step consumed on this rank (its local batch size). A checkpoint taken after that call resumes with
the next unconsumed sample, whatever the loader had prefetched. The sampler warns if a state is
saved after iteration began but ``advance`` was never called.

Epochs follow the ``DistributedSampler`` discipline: call :meth:`~ResumableSampler.set_epoch` before
each epoch's ``iter(loader)``. ``set_epoch`` with a new epoch starts it at position 0; with the
epoch just restored it keeps the restored position, so the usual loop resumes unchanged::

    sampler.load_state_dict(saved)                       # epoch 3, position 1200
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)                         # 3: keeps 1200; 4, 5...: start at 0
        for batch in loader:
            train(batch); sampler.advance(len(batch))

The first ``__iter__`` after :meth:`load_state_dict` starts at the restored position; any other
starts the epoch from its beginning (iterating an epoch twice repeats it, as DistributedSampler
does). A state saved with another dataset length, seed, shuffle or drop_last is refused: it
would silently name other samples. The position is per rank, and equal on every rank when each
rank consumes the same number of samples per step, so rank 0's state may be loaded everywhere.

**Another world size (elastic resume).** Rank ``r`` of ``W`` takes every ``W``-th index of the
epoch's order, so after ``p`` samples per rank the job as a whole has consumed exactly the first
``p * W`` indices of that order. A state saved by ``W`` ranks and loaded by ``W'`` therefore
restarts its position at 0 over the rest of the epoch (:attr:`~ResumableSampler.base` = ``p * W``),
split over the ``W'`` ranks the same way (padded or trimmed to a multiple of ``W'``): no sample of
the epoch is skipped or seen twice (beyond DistributedSampler's padding). The next epoch is split
over ``W'`` from its start, as a fresh run on ``W'`` ranks would.

:class:`spotguard.DataLoader` builds on this sampler: it advances it by each batch it hands out (a
user ``advance`` call is then refused) and seeds each sample from (seed, rank, epoch, passes,
position), which is why the state also counts :attr:`~ResumableSampler.passes`. Iterated by a
plain torch ``DataLoader`` instead, the sampler warns at the first save (:class:`NotExactWarning`):
torch draws that loader's iterator seeds from the global RNG, so the data order resumes but dropout
and augmentation do not.

For a torchdata ``StatefulDataLoader`` (which snapshots its own sampler and workers with each batch)
:class:`LoaderState` makes the loader a checkpoint state entry.

Exceptions::

    SamplerStateError (ValueError)   a state that does not fit this sampler, or a bad advance()
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterator, Sized
from typing import Any

__all__ = ["ResumableSampler", "LoaderState", "SamplerStateError", "NotExactWarning"]

_FORMAT = 1
_MUST_MATCH = ("num_items", "seed", "shuffle", "drop_last")


class SamplerStateError(ValueError):
    """The saved state does not belong to this sampler, or the loop advanced past the epoch."""


class NotExactWarning(UserWarning):
    """A data pipeline whose resume cannot be bit-identical, named at the first save with its fix."""


PLAIN_LOADER_WARNING = (
    "a ResumableSampler is iterated by a plain torch DataLoader: the loader draws each iterator's "
    "seed from the global torch RNG and its workers' RNG streams start over on resume, so after a "
    "resume dropout masks and random augmentations differ from an uninterrupted run. Build the "
    "loader with spotguard.DataLoader (same arguments) to resume bit-identically.")


STATEFUL_WORKERS_WARNING = (
    "a StatefulDataLoader with workers does not resume bit-identically: its workers' RNG streams "
    "start over on resume, so random augmentation drawn inside the dataset differs, and with torchdata "
    "0.11 a resume after the first epoch ends in another state even without augmentation. For a "
    "map-style dataset use spotguard.DataLoader (same arguments), or a StatefulDataLoader with "
    "num_workers=0.")


def _iterated_by_torch_loader(depth: int = 8) -> bool:
    """Whether a torch DataLoader iterator is among the callers (a bounded look up the stack)."""
    base = getattr(sys.modules.get("torch.utils.data.dataloader"), "_BaseDataLoaderIter", None)
    frame = sys._getframe(2) if base is not None else None
    for _ in range(depth):
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), base):
            return True
        frame = frame.f_back
    return False


def _topology(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Fill what was not given from torch.distributed if it is initialised, else a world of one."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    live = dist is not None and dist.is_available() and dist.is_initialized()
    world_size = world_size if world_size is not None else (dist.get_world_size() if live else 1)
    rank = rank if rank is not None else (dist.get_rank() if live else 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def _sizes(rest: int, world: int, drop_last: bool) -> tuple[int, int]:
    """``(num_samples, total_size)`` of ``rest`` indices split over ``world`` ranks, as
    DistributedSampler sizes them (padded up, or trimmed down with ``drop_last``)."""
    num_samples = math.ceil((rest - world) / world) if drop_last and rest % world else math.ceil(rest / world)
    return num_samples, num_samples * world


def ids_digest(taken: list[tuple[int, int, int, int, list[int]]]) -> str | None:
    """A digest of the sample ids in :meth:`ResumableSampler.take_consumed`'s chunks (None for none)."""
    import hashlib
    from array import array

    if not taken:
        return None
    ids = array("q")
    for chunk in taken:
        ids.extend(chunk[-1])
    return hashlib.blake2b(ids.tobytes(), digest_size=8).hexdigest()


class ResumableSampler:
    """A ``DistributedSampler``-compatible sampler whose position survives a restart.

    A duck-typed ``torch.utils.data.Sampler`` (``__iter__`` and ``__len__``; the DataLoader accepts
    any iterable of indices) so that ``import spotguard`` does not import torch.
    """

    def __init__(self, data_source_or_len: Sized | int, *, shuffle: bool = True, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False) -> None:
        n = data_source_or_len if isinstance(data_source_or_len, int) else len(data_source_or_len)
        if n < 0:
            raise ValueError(f"dataset length must be >= 0, got {n}")
        self.num_items, self.seed, self.shuffle, self.drop_last = n, int(seed), shuffle, drop_last
        self.rank, self.world_size = _topology(rank, world_size)
        self.base = 0
        """Samples of this epoch the whole job consumed before the current split began: nonzero only
        in an epoch resumed on another world size (see the module's docstring)."""
        self._split(0)
        self.epoch = 0
        self.position = 0
        """Samples of this epoch handed to the loop on this rank (see :meth:`advance`)."""
        self.passes = 0
        """Passes begun over this sampler (fresh ``__iter__`` calls): with ``epoch`` and
        ``position`` it names a sample's place in the run, from which :class:`spotguard.DataLoader`
        derives the sample's random seed."""
        self.restored = 0
        """How many times a state was loaded: a loader iterator begun before that starts over."""
        self._resume_pending = False
        self._iterated = self._advanced = False
        self._owner: Any = None
        self._plain_loader = self._warned_plain = False
        self.consumed: list[tuple[int, int, int, int, int]] | None = None
        """With a list here (a run that records itself), each advance appends (epoch, passes, base,
        position, n): :meth:`take_consumed` names the sample ids the loop drew since the last call."""
        self._order: tuple[tuple[int, int, int], list[int]] | None = None

    def _split(self, base: int) -> None:
        """Split the epoch's indices from ``base`` on over the ranks (DistributedSampler's sizes)."""
        self.base = base
        self.num_samples, self.total_size = _sizes(self.num_items - base, self.world_size, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``__iter__`` draws; a new epoch starts at position 0."""
        if epoch == self.epoch:
            return
        if self._resume_pending:
            warnings.warn(f"set_epoch({epoch}) discards the restored position (epoch {self.epoch}, "
                          f"position {self.position}); resume with range(sampler.epoch, ...)",
                          stacklevel=2)
        self.epoch, self.position, self._resume_pending = int(epoch), 0, False
        self._split(0)

    def advance(self, n_samples: int) -> None:
        """Record that the loop consumed ``n_samples`` more samples on this rank (one batch)."""
        if self._owner is not None:
            raise SamplerStateError("this sampler belongs to a spotguard.DataLoader, which advances it "
                                    "by each batch it hands out: remove the sampler.advance() call")
        self._advance(n_samples)

    def _again(self) -> None:
        """Its ``spotguard.DataLoader`` lost its workers: the next ``__iter__`` goes on from the
        current position of this pass, as after loading a checkpoint taken now."""
        self._resume_pending = True
        self.restored += 1

    def _advance(self, n_samples: int) -> None:
        if n_samples < 0 or self.position + n_samples > self.num_samples:
            raise SamplerStateError(
                f"advance({n_samples}) at position {self.position} passes the end of the epoch "
                f"({self.num_samples} samples on this rank)")
        if self.consumed is not None:
            self.consumed.append((self.epoch, self.passes, self.base, self.position, int(n_samples)))
        self.position += int(n_samples)
        self._advanced = True

    def take_consumed(self) -> list[tuple[int, int, int, int, list[int]]]:
        """The samples drawn since the last call, one ``(epoch, pass, first, stride, ids)`` per
        advance: ``ids[j]`` sits at place ``first + j * stride`` of the epoch's order over the whole
        job (this rank takes every ``world_size``-th from ``base + rank``; a place past the dataset
        is DistributedSampler's padding). Places, unlike per-rank positions, mean the same on any
        number of ranks: a job resumed on another world size goes on at the next place."""
        taken = [(epoch, passes, base + start * self.world_size + self.rank, self.world_size,
                  self._indices(epoch, base)[start:start + n])
                 for epoch, passes, base, start, n in self.consumed or ()]
        if self.consumed:
            self.consumed.clear()
        return taken

    def take_ids_digest(self) -> str | None:
        """A digest of the sample ids consumed since the last call (None when none were, or
        nothing is tracked): equal for two runs exactly when they drew the same samples."""
        return ids_digest(self.take_consumed())

    def __iter__(self) -> Iterator[int]:
        start = self.position if self._resume_pending else 0
        self.passes += 0 if self._resume_pending else 1
        if not self._resume_pending and self.base:
            self._split(0)  # a second pass over the epoch repeats all of it
        self.position, self._resume_pending = start, False
        self._iterated = True
        if self._owner is None and not self._plain_loader:
            self._plain_loader = _iterated_by_torch_loader()
        return iter(self._indices()[start:])

    def __len__(self) -> int:
        """Indices the next ``__iter__`` yields: the rest of a restored epoch, else a whole one."""
        return self.num_samples - (self.position if self._resume_pending else 0)

    def _indices(self, epoch: int | None = None, base: int | None = None) -> list[int]:
        """This rank's indices for ``epoch`` from ``base`` on (defaults: the current ones), exactly
        as DistributedSampler computes them when ``base`` is 0; the last split's are kept."""
        key = (self.epoch if epoch is None else epoch, self.seed, self.base if base is None else base)
        if self._order is None or self._order[0] != key:
            self._order = (key, self._compute_indices(key[0], key[2]))
        return self._order[1]

    def _compute_indices(self, epoch: int, base: int = 0) -> list[int]:
        import torch

        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            indices = torch.randperm(self.num_items, generator=generator).tolist()
        else:
            indices = list(range(self.num_items))
        indices = indices[base:]
        world = self.world_size
        total_size = _sizes(len(indices), world, self.drop_last)[1]
        if not self.drop_last and indices:
            padding = total_size - len(indices)
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        else:
            indices = indices[:total_size]
        return indices[self.rank : total_size : world]

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and bools: the position, and what must match for it to name the same data."""
        if self._iterated and not self._advanced:
            self._iterated = False  # warn once per pass, not at every save
            warnings.warn("ResumableSampler.advance() was never called: the saved position is the "
                          "start of the epoch, so a resumed run repeats it", stacklevel=2)
        if self._plain_loader and not self._warned_plain:
            self._warned_plain = True
            warnings.warn(PLAIN_LOADER_WARNING, NotExactWarning, stacklevel=2)
        return {"format": _FORMAT, "epoch": self.epoch, "position": self.position,
                "passes": self.passes, "base": self.base, "world_size": self.world_size,
                "rank": self.rank, **{key: getattr(self, key) for key in _MUST_MATCH}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (epoch, position); the next ``__iter__`` yields the rest of that epoch, re-split
        over this world when the state was saved by another number of ranks."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise SamplerStateError(f"not a ResumableSampler state of format {_FORMAT}")
        for key in _MUST_MATCH:
            if state.get(key) != getattr(self, key):
                raise SamplerStateError(f"sampler state was saved with {key}={state.get(key)!r}, "
                                        f"this sampler has {key}={getattr(self, key)!r}")
        epoch, position, passes = state.get("epoch"), state.get("position"), state.get("passes", 0)
        base, world = state.get("base", 0), state.get("world_size")
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int) and position >= 0
                and isinstance(passes, int) and passes >= 0 and isinstance(base, int)
                and 0 <= base <= self.num_items and isinstance(world, int) and world >= 1):
            raise SamplerStateError(f"bad epoch/position/passes/base/world_size in sampler state: {epoch!r}, "
                                    f"{position!r}, {passes!r}, {base!r}, {world!r}")
        if world != self.world_size:  # elastic resume: what the whole job consumed, re-split here
            base, position = min(base + position * world, self.num_items), 0
        if position > _sizes(self.num_items - base, self.world_size, self.drop_last)[0]:
            raise SamplerStateError(f"sampler position {position} passes the end of its epoch")
        self._split(base)
        self.epoch, self.position, self.passes, self._resume_pending = epoch, position, passes, True
        self.restored += 1


class LoaderState:
    """A checkpoint state entry for a loader that tracks its own position.

    torchdata's ``StatefulDataLoader`` already snapshots, with each batch it returns, the state of
    its sampler, its workers and their datasets, so its ``state_dict()`` describes exactly the
    batches handed to the loop (prefetch included). This adapter only checks the loader has that
    protocol, so a plain ``DataLoader`` fails at setup with a clear error instead of at the first
    save. Call ``load_state_dict`` before ``iter(loader)``: the loader applies it then.

    Observed with torchdata 0.11: a loader built with ``generator=`` and ``num_workers=0`` resumes
    the interrupted epoch exactly but draws the *next* epoch's order differently; leave
    ``generator`` unset (the sampler then seeds, and saves, a private generator). A loader left
    without one would draw each iterator's base seed from the global torch RNG, at another point of
    its stream in a resumed run, so this adapter gives it a private generator for that draw. Its
    workers' RNG streams still start over on resume, and with torchdata 0.11 a loader with workers
    resumed after its first epoch ends in another state even over data with no randomness
    (measured, tests/client/test_resume_matrix.py): with ``num_workers > 0`` the first save warns
    (:class:`NotExactWarning`). With ``num_workers=0`` it resumes bit-identically.
    """

    def __init__(self, loader: Any) -> None:
        if not (callable(getattr(loader, "state_dict", None))
                and callable(getattr(loader, "load_state_dict", None))):
            raise TypeError(f"{type(loader).__name__} has no state_dict/load_state_dict: use "
                            "torchdata's StatefulDataLoader, or a DataLoader with a "
                            "ResumableSampler")
        if getattr(loader, "generator", False) is None:
            import torch  # the loader is torch's: its iterators' seeds must not come from the global RNG

            loader.generator = torch.Generator().manual_seed(0)
        self.loader, self._warned = loader, False

    def state_dict(self) -> dict[str, Any]:
        if getattr(self.loader, "num_workers", 0) and not self._warned:
            self._warned = True
            warnings.warn(STATEFUL_WORKERS_WARNING, NotExactWarning, stacklevel=2)
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
