"""Snapshot a training state into reusable CPU buffers: the only part of a save the loop waits for.

:meth:`Stager.snapshot` calls ``state_dict()`` on stateful entries, encodes the non-tensor tree to
JSON-able values at once (so later mutation of Python values cannot leak into the checkpoint), and
copies every tensor into a staging buffer with one ``copy_``. Buffers are reused while the tensor's
dtype and shape stay the same, so a steady-state save is a memcpy with no allocation or page faults;
they are pinned when CUDA is available so device-to-host copies are asynchronous. The caller must not
snapshot again before the previous snapshot has been written.

Memory: one staging copy of the state's tensors, whether allocated by :meth:`Stager.prepare` or by
the first snapshot. :meth:`~Stager.prepare` allocates and pre-faults the buffers in a background
thread once the shapes are known, so the first save is a plain memcpy too. A snapshot that comes
while the preparation runs stops it after the page range in progress, keeps what is ready and
allocates the rest itself: the snapshot never depends on the preparation, only its speed does.
Large buffers start on a page boundary so that the writer can hand them to ``O_DIRECT`` writes. A
restore reads into such buffers and hands them over (:meth:`Stager.adopt`): its memory is the
staging copy, not one more on top of it.

Small tensors (under the writer's ``large_bytes``) are packed: their staging buffers are views into
one arena laid out as ``small.bin`` will be (:func:`layout`), so the background persist writes the
arena as it is, with no per-tensor work, and reuses the layout (``Snapshot.packed``) while the same
buffers stage the same tensors. A snapshot that finds the layout changed (a new tensor, another
shape, a restore's adopted buffers) builds a new arena once, in its own copy.

Interpreter exit: a preparation still running is stopped and joined by an ``atexit`` handler, with
or without :meth:`~spotguard.checkpoint.Checkpointer.close`. Its thread is a daemon thread that
spends its time inside torch calls with the GIL released; left running, finalisation ends it where
it next takes the GIL back, inside a C++ destructor (``noexcept``) of torch's binding, and the
forced unwinding of ``pthread_exit`` through it calls ``std::terminate``: "terminate called without
an active exception", status 134, about one exit in two after a ``load_latest``.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from spotguard._forkgate import in_torch_work, torch_work
from spotguard.checkpoint._hugepages import keep_from_forks, mapped_bytes
from spotguard.checkpoint._workers import Throttle, lower_priority
from spotguard.checkpoint.errors import UnsupportedStateError
from spotguard.checkpoint.format import dtype_name, encode

__all__ = ["Snapshot", "Packed", "Stager", "entry_kind", "tensor_specs", "aligned_bytes", "layout", "PAGE",
           "ALIGNED_MIN_BYTES", "SMALL", "SMALL_ALIGN"]

PAGE = 4096
"""Alignment of large staging buffers (the ``O_DIRECT`` requirement of common file systems)."""
ALIGNED_MIN_BYTES = 1 << 20
"""Buffers this large or larger are page aligned (4 KiB of slack each); smaller ones go to small.bin."""
_TOUCH_BYTES = 64 << 20
"""Pre-faulting works in ranges of this size: the most a racing snapshot waits for it."""
_SMALL_BATCH = 4096
"""Small buffers a preparation allocates in one throttled piece (about 10 ms of work)."""

Spec = tuple[torch.Size, torch.dtype]
SMALL = "small.bin"
SMALL_ALIGN = 64
"""Offset alignment of each tensor packed in ``small.bin``."""

_RUNNING: "weakref.WeakSet[_Preparation]" = weakref.WeakSet()
"""Preparations whose thread may still run, stopped at interpreter exit (see the module docstring)."""


_STAGERS: "weakref.WeakSet[Stager]" = weakref.WeakSet()
"""Every Stager, for :func:`_forget_in_child`."""


def _forget_in_child() -> None:
    """After a fork, in the child: drop every staging buffer. Their mappings are kept from forked
    children (``MADV_DONTFORK``): otherwise each loader worker forked (every epoch, by default)
    would share them copy-on-write, and the next snapshot would fault and copy every page of them
    (1.2 s a GiB against 0.1 s here: the stall of the first save after each fork). A save in the
    child allocates afresh; the preparation thread does not exist there. What is dropped is kept
    referenced, never freed in the child: no torch call runs in this hook."""
    for stager in list(_STAGERS):
        _UNMAPPED_IN_CHILD.append((stager._buffers, stager._packed, stager._prep))
        stager._buffers, stager._packed, stager._prep = [], None, None
    _RUNNING.clear()


_UNMAPPED_IN_CHILD: list[Any] = []
"""In a forked child, the staging buffers it did not inherit (see :func:`_forget_in_child`)."""


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _stop_all() -> None:
    """Stop every running preparation before finalisation cuts its thread off inside torch."""
    for prep in list(_RUNNING):
        prep.stop()


def layout(tensors: Iterable[torch.Tensor], large_bytes: int) -> tuple[list[dict[str, Any]], int]:
    """Where each tensor goes in a part: a file of its own from ``large_bytes`` up, else ``small.bin``
    at the next ``SMALL_ALIGN`` offset; returns the index (``dtype``, ``shape``, ``nbytes``, ``file``,
    ``offset`` per tensor) and the size of ``small.bin``."""
    return layout_specs(((t.shape, t.dtype) for t in tensors), large_bytes)


def layout_specs(specs: Iterable[Spec], large_bytes: int) -> tuple[list[dict[str, Any]], int]:
    """:func:`layout` of tensors of these ``(shape, dtype)``."""
    index, small_end = [], 0
    for i, (shape, dtype) in enumerate(specs):
        nbytes = shape.numel() * dtype.itemsize
        entry = {"dtype": dtype_name(dtype), "shape": list(shape), "nbytes": nbytes}
        if nbytes >= large_bytes:
            entry.update(file=f"tensors/{i:06d}.bin", offset=0)
        else:
            small_end = -(-small_end // SMALL_ALIGN) * SMALL_ALIGN
            entry.update(file=SMALL, offset=small_end)
            small_end += nbytes
        index.append(entry)
    return index, small_end


@dataclass
class Packed:
    """A snapshot's layout, computed once for the buffers that stage it: ``arena`` is ``small.bin``
    (``size`` bytes; the small tensors' staging buffers are views into it), ``index`` what
    :func:`layout` gives for them, ``large_bytes`` its threshold. Read only."""

    arena: torch.Tensor
    size: int
    index: list[dict[str, Any]]
    large_bytes: int
    staged: list[torch.Tensor]
    """The staging buffers, in order: a snapshot staged into these same tensors has this layout."""

    runs_json: dict[tuple[int, int], str] = field(default_factory=dict, repr=False)
    """``index[start:end]`` as JSON, for the state digest of the entry owning that run (made once
    by the first persist that needs it; see :func:`.commit.part_digest`)."""

    @cached_property
    def index_json(self) -> str:
        """``index`` as tree.json spells it, made once by the first persist that writes it."""
        return json.dumps(self.index, separators=(",", ":"))

    @property
    def views(self) -> dict[int, torch.Tensor]:
        """Position -> the small tensor's view into ``arena``."""
        return {i: self.staged[i] for i, entry in enumerate(self.index) if entry["file"] == SMALL}


@dataclass
class Snapshot:
    """A consistent CPU copy of a state: ``entries`` are ``[name, kind, encoded tree]``."""

    entries: list[list[Any]]
    tensors: list[torch.Tensor]
    nbytes: int
    ends: list[int] = field(default_factory=list)
    """``ends[k]``: one past the index of entry k's last tensor (entries own contiguous runs)."""
    packed: Packed | None = None
    """Set by :meth:`Stager.snapshot` when its small tensors sit in one arena laid out as small.bin."""


def entry_kind(value: Any) -> str:
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return "stateful"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "mapping" if isinstance(value, Mapping) else "value"


def _collect(state: Mapping[str, Any], names: Iterable[str] | None, sources: list[torch.Tensor],
             skip_unsupported: bool = False) -> tuple[list[list[Any]], list[int]]:
    """Encode the entries of ``state`` (all, or only ``names``), appending their tensors to ``sources``."""
    wanted = None if names is None else set(names)
    entries, ends = [], []
    for name, value in state.items():
        if wanted is None or name in wanted:
            kind = entry_kind(value)
            tree = value.state_dict() if kind == "stateful" else value
            start = len(sources)
            try:
                entries.append([str(name), kind, encode(tree, sources, str(name))])
            except UnsupportedStateError:
                if not skip_unsupported:
                    raise
                del sources[start:]  # e.g. a sharded entry: its DTensors are staged elsewhere
            ends.append(len(sources))
    return entries, ends


def tensor_specs(state: Mapping[str, Any], names: Iterable[str] | None = None) -> list[Spec]:
    """The ``(shape, dtype)`` of every tensor a snapshot of ``state`` would stage, in order. Entries
    that cannot be staged here (DTensors) are left out: a wrong guess costs an allocation, no more.
    So are stateful entries other than modules and optimizers: their ``state_dict()`` may have side
    effects meant for a save (a data module's one-time checks), and it is not called before one."""
    return [(t.shape, t.dtype) for t in _sources(state, names)]


def _sources(state: Mapping[str, Any], names: Iterable[str] | None = None) -> list[torch.Tensor]:
    pure = {k: v for k, v in state.items() if entry_kind(v) != "stateful" or isinstance(v, _PURE_STATEFUL)}
    sources: list[torch.Tensor] = []
    _collect(pure, names, sources, skip_unsupported=True)
    return sources


_PURE_STATEFUL = (torch.nn.Module, torch.optim.Optimizer)


class Stager:
    """Owns the staging buffers; one instance per :class:`~spotguard.checkpoint.Checkpointer`."""

    def __init__(self, pin_memory: bool | None = None, large_bytes: int | None = None) -> None:
        _STAGERS.add(self)
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: list[torch.Tensor] = []
        self._prep: _Preparation | None = None
        self._large = large_bytes
        """Pack tensors under this many bytes into one arena (:class:`Packed`); None: never."""
        self._packed: Packed | None = None

    def prepare(self, specs: list[Spec], *, nice: int | None = None, cpu_share: float | None = None) -> None:
        """Allocate and pre-fault buffers for tensors of ``specs`` in a background thread (reniced to
        ``nice``, capped at ``cpu_share`` of a CPU); returns at once. Matching buffers are kept."""
        self._settle()
        self._prep = _Preparation(specs, self._buffers, self._new_buffer, nice, cpu_share, self._large, self._arena)

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait for :meth:`prepare` to finish and adopt its buffers; False if still running."""
        if self._prep is not None and not self._prep.join(timeout):
            return False
        self._settle()
        return True

    def _settle(self) -> None:
        """Stop a running preparation (after its current page range) and adopt its buffers (and,
        when it finished, the layout it packed them in)."""
        if self._prep is not None:
            self._buffers, packed, self._prep = *self._prep.stop(), None
            if packed is not None:
                self._packed = packed

    def snapshot(self, state: Mapping[str, Any], names: Iterable[str] | None = None) -> Snapshot:
        """Copy the entries of ``state`` (all, or only ``names``) into the staging buffers.

        The garbage collector is off meanwhile: encoding a state of 80,000 tensors makes objects
        enough to start collections that scanned the whole heap, 35-40 % of this stall (what the loop
        waits for); they run after, where the loop allocates next."""
        self._settle()
        collecting = gc.isenabled()
        gc.disable()
        try:
            sources: list[torch.Tensor] = []
            entries, ends = _collect(state, names, sources)
            staged = [self._stage(i, t) for i, t in enumerate(sources)]
            del self._buffers[len(sources) :]
            if any(t.is_cuda for t in sources):
                torch.cuda.synchronize()  # before packing: a new arena copies from the staged buffers
            packed = self._pack(staged) if self._large is not None else None
        finally:
            if collecting:
                gc.enable()
        return Snapshot(entries, staged, sum(t.numel() * t.element_size() for t in staged), ends, packed)

    def _pack(self, staged: list[torch.Tensor]) -> Packed | None:
        """The layout of ``staged``: the last one when the same buffers staged it; the last arena
        with a new index when only large tensors changed; else a new arena with the small tensors
        moved into it (``staged`` and the staging buffers pointed at their places there). None
        without small tensors."""
        old = self._packed
        if old is not None and len(old.staged) == len(staged) and all(a is b for a, b in zip(old.staged, staged)):
            return old
        assert self._large is not None
        index, size = layout(staged, self._large)
        small = [i for i, entry in enumerate(index) if entry["file"] == SMALL]
        if not small:
            self._packed = None
            return None
        old_small = [] if old is None else [i for i, entry in enumerate(old.index) if entry["file"] == SMALL]
        if old is not None and old.size == size and old_small == small and all(
                old.staged[i] is staged[i] and old.index[i]["offset"] == index[i]["offset"] for i in small):
            arena = old.arena  # the small tensors stayed where they were
        else:
            arena = self._arena(size).zero_()
            for i in small:
                view = _view(arena, index[i], staged[i].shape, staged[i].dtype)
                view.copy_(staged[i])
                staged[i] = self._buffers[i] = view
        self._packed = Packed(arena, size, index, self._large, list(staged))
        return self._packed

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The staging buffers after the last snapshot (a prepared set is adopted by the next one)."""
        return list(self._buffers)

    def _stage(self, index: int, src: torch.Tensor) -> torch.Tensor:
        if index < len(self._buffers):
            buf = self._buffers[index]
            if not _fits(buf, (src.shape, src.dtype)):
                buf = self._buffers[index] = self._new_buffer((src.shape, src.dtype))
        else:
            buf = self._new_buffer((src.shape, src.dtype))
            self._buffers.append(buf)
        buf.copy_(src, non_blocking=src.is_cuda)
        return buf

    def _arena(self, size: int) -> torch.Tensor:
        """The buffer small.bin is staged in (pinned like the others; page aligned from 1 MiB), not
        zeroed yet: the caller zeroes it (the alignment gaps between tensors are written as they are,
        and must read as zeros)."""
        return torch.empty(size, dtype=torch.uint8, pin_memory=True) if self._pin else aligned_bytes(size, True)

    def _new_buffer(self, spec: Spec) -> torch.Tensor:
        shape, dtype = spec
        nbytes = _nbytes(spec)
        if self._pin:  # pinned memory is page aligned already
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        return aligned_bytes(nbytes, True).view(dtype).view(shape)

    def adopt(self, buffers: list[tuple[torch.Tensor, str | None] | None],
              state: Mapping[str, Any]) -> list[Spec] | None:
        """Take a restore's read buffers (``buffers[i]``: the i-th tensor of the snapshot the
        checkpoint holds and the entry it belongs to, None where none fits) as the staging buffers,
        so that the restore's memory becomes the staging copy instead of coming on top of it. A
        buffer the restored ``state`` may hold itself is left out, since the next snapshot must never
        write into live state: one that a module's or optimizer's state (``Optimizer.load_state_dict``
        keeps the tensors it is given), a tensor or a mapping references now, and every one of other
        stateful entries (their ``state_dict()`` is not called outside a save). Not when pinned.
        Returns :func:`tensor_specs` of ``state`` (taken here anyway), None when pinned."""
        if self._pin:
            return None
        self._settle()
        sources = _sources(state)
        live = {t.untyped_storage().data_ptr() for t in sources}
        opaque = {k for k, v in state.items() if entry_kind(v) == "stateful" and not isinstance(v, _PURE_STATEFUL)}
        self._buffers = [b[0] if b is not None and b[1] is not None and b[1] not in opaque
                         and b[0].untyped_storage().data_ptr() not in live else _NOTHING for b in buffers]
        for buf in self._buffers:  # staging only now: no forked child needs them (see _FORGET_IN_CHILD)
            if buf.numel():
                keep_from_forks(buf)
        self._packed = None  # the next snapshot packs the adopted buffers' small tensors anew
        return [(t.shape, t.dtype) for t in sources]

    def release(self) -> None:
        """Drop the staging buffers (the next snapshot allocates again)."""
        self._settle()
        self._buffers, self._packed = [], None


_NOTHING = torch.empty(0, dtype=torch.uint8)
"""A placeholder of :meth:`Stager.adopt`: fits only an empty uint8 tensor (which it serves well)."""


def aligned_bytes(nbytes: int, private: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes``; from :data:`ALIGNED_MIN_BYTES` on, page aligned in a mapping of
    its own, in huge pages from 2 MiB on where they pay, and with ``private`` kept from forked
    children (:mod:`._hugepages`)."""
    if nbytes < ALIGNED_MIN_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    mapped = mapped_bytes(nbytes, private=private)
    if mapped is not None:
        return mapped
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start : start + nbytes]


def _view(arena: torch.Tensor, entry: dict[str, Any], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` at ``entry``'s offset in ``arena`` (a small.bin)."""
    return arena[entry["offset"] : entry["offset"] + entry["nbytes"]].view(dtype).view(shape)


def _nbytes(spec: Spec) -> int:
    return spec[0].numel() * spec[1].itemsize


def _fits(buf: torch.Tensor, spec: Spec) -> bool:
    return buf.shape == spec[0] and buf.dtype == spec[1]


class _Preparation:
    """The background thread of :meth:`Stager.prepare`: builds a new buffer list, reusing ``old``
    buffers that fit, allocating and touching every page of the others. With ``large`` (packing),
    the small tensors' buffers are views into one arena laid out as small.bin, and a preparation
    that finishes hands over that layout (:class:`Packed`) with the buffers."""

    def __init__(self, specs: list[Spec], old: list[torch.Tensor], new_buffer: Any, nice: int | None,
                 share: float | None, large: int | None = None, new_arena: Any = None) -> None:
        self._specs, self._old, self._new_buffer = specs, list(old), new_buffer
        self._large, self._new_arena = large, new_arena
        self._ready: list[torch.Tensor] = []
        self._packed: Packed | None = None
        self._stopping = threading.Event()
        throttle = Throttle(None if share is None or share >= 1 else share, threads=1)
        self._thread = threading.Thread(target=self._run, args=(nice, throttle),
                                        name="spotguard-ckpt-prepare", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _run(self, nice: int | None, throttle: Throttle) -> None:
        lower_priority(nice)
        index, arena = None, None
        if self._large is not None:
            index, size = layout_specs(self._specs, self._large)
            if any(entry["file"] == SMALL for entry in index):
                arena = throttle.run(in_torch_work, self._new_arena, size)
                _touch(arena, throttle, self._stopping, zero=True)
        small: list[tuple[int, Spec]] = []  # consecutive small buffers: made in one throttled piece
        for i, spec in enumerate(self._specs):
            if self._stopping.is_set():
                return
            packs = index is not None and index[i]["file"] == SMALL
            if not packs and i < len(self._old) and _fits(self._old[i], spec):
                self._flush(small, throttle, arena, index)
                self._ready.append(self._old[i])
            elif packs or _nbytes(spec) < ALIGNED_MIN_BYTES:
                small.append((i, spec))
                if len(small) >= _SMALL_BATCH:
                    self._flush(small, throttle, arena, index)
            else:
                self._flush(small, throttle, arena, index)
                buf = throttle.run(in_torch_work, self._new_buffer, spec)
                self._ready.append(buf)
                _touch(buf, throttle, self._stopping)
        self._flush(small, throttle, arena, index)
        if arena is not None and index is not None and not self._stopping.is_set():
            assert self._large is not None
            self._packed = Packed(arena, size, index, self._large, list(self._ready))

    def _flush(self, small: list[tuple[int, Spec]], throttle: Throttle, arena: torch.Tensor | None,
               index: list[dict[str, Any]] | None) -> None:
        """Make the batched small buffers in one piece of throttled work: one throttle sleep per
        buffer made 60,000 1 KiB tensors take 19 s to prepare at a quarter of a core. Views into the
        (touched) arena when packing; else buffers of their own, not touched (a malloc'd buffer this
        small shares its pages, faulted by the first snapshot)."""
        if small and not self._stopping.is_set():
            if arena is not None and index is not None:
                made = throttle.run(in_torch_work, lambda: [_view(arena, index[i], *spec) for i, spec in small])
            else:
                made = throttle.run(in_torch_work, lambda: [self._new_buffer(spec) for _, spec in small])
            self._ready.extend(made)
        small.clear()

    def join(self, timeout: float | None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> tuple[list[torch.Tensor], Packed | None]:
        """Stop, wait for the range in progress, and return the buffers: the ready ones first, then
        the old ones at the positions not reached (positional reuse stays right for what is left);
        and the layout the buffers are packed in, when the preparation finished."""
        self._stopping.set()
        self._thread.join()
        _RUNNING.discard(self)
        return self._ready + self._old[len(self._ready) :], self._packed


def _touch(buf: torch.Tensor, throttle: Throttle, stopping: threading.Event, zero: bool = False) -> None:
    """Write one byte of every page of ``buf`` so the kernel maps them now, not in the snapshot copy.
    torch releases the GIL (numpy's fill would hold it through every page fault), and a range of
    16384 pages stays under torch's grain size, so the fill runs serially in this (reniced, capped)
    thread instead of fanning out to the intra-op thread pool. ``zero``: every byte (an arena, once;
    a 64 MiB range may then fan out)."""
    with torch_work():  # see spotguard._forkgate: every torch call of this thread is one
        flat = buf.reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), _TOUCH_BYTES):
        if stopping.is_set():
            return
        throttle.run(in_torch_work, _zero_range, flat, start, 1 if zero else PAGE)


def _zero_range(flat: torch.Tensor, start: int, every: int) -> None:
    flat[start : start + _TOUCH_BYTES : every].zero_()
