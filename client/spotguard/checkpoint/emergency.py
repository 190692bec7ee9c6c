"""The emergency save: the newest state committed at the disk's speed, straight from live memory.

When a stop notice comes the training loop is halted, so the state cannot change under the save and
no snapshot copy is needed (a periodic save copies first because training goes on; here the copy
would only cost time, and on the first save of a process also the allocation of every buffer).
:func:`live_snapshot` encodes the tree and keeps references to the live tensors; a
:class:`LiveWriter` then writes the same files as a periodic save (same names, same manifest, same
digests, so loading, verification and the state digest are unchanged):

* a CPU tensor is written from its own memory (a memoryview of its bytes) in segments spread over
  :data:`WRITE_THREADS` threads with ``pwrite``, each file's write-back started as soon as it is
  written and one fsync per file, while its digests (sha256, XXH3) run in a hashing thread beside the writes.
  Several streams keep work queued for the disk while others copy into the page cache
  (``dd conv=fsync`` copies everything first and only then flushes);
* a CUDA tensor is streamed device-to-host through a pair of pinned chunks on a side stream: the
  copy of chunk k+1 overlaps hashing and writing chunk k (:func:`stream_tensor`); the chunks are
  kept by the :class:`Emergency` of the Checkpointer, so only the first emergency save allocates.

The commit protocol around it is the periodic one (tmp dir, fsync, rename, directory fsync), so a
SIGKILL mid-save leaves the previous checkpoint loadable. :class:`Emergency` also measures the
path's bandwidth, from which ``Run`` decides whether an emergency save fits before a deadline.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from spotguard.checkpoint import _fs
from spotguard.checkpoint._workers import Workers
from spotguard.checkpoint.commit import _Writer
from spotguard.checkpoint.format import encode
from spotguard.checkpoint.staging import Snapshot, entry_kind

__all__ = ["ASSUMED_THROUGHPUT", "Emergency", "LiveWriter", "live_snapshot", "stream_tensor"]

ASSUMED_THROUGHPUT = 100e6
"""Bytes per second assumed before any save was measured: a conservative local-disk figure."""
WRITE_THREADS = 4
"""Concurrent write streams. On the shared virtio disk measured, one stream that also hashed was
slower than ``dd``, four kept pace with it; more made no difference beyond the noise."""
SEGMENT_BYTES = 64 << 20
"""The most one thread writes of a file at a time: a large tensor is spread over several threads."""
STREAM_CHUNK_BYTES = 16 << 20
"""Size of each pinned chunk a CUDA tensor streams through."""


def live_snapshot(state: Mapping[str, Any], names: Iterable[str] | None = None) -> Snapshot:
    """The entries of ``state`` (all, or only ``names``) encoded, their tensors referenced, not
    copied: valid only while nothing changes the state (the loop is stopped)."""
    wanted = None if names is None else set(names)
    tensors: list[torch.Tensor] = []
    entries, ends = [], []
    for name, value in state.items():
        if wanted is None or name in wanted:
            kind = entry_kind(value)
            tree = value.state_dict() if kind == "stateful" else value
            entries.append([str(name), kind, encode(tree, tensors, str(name))])
            ends.append(len(tensors))
    for device in {t.device for t in tensors if t.is_cuda}:  # the writer threads' streams must
        torch.cuda.synchronize(device)  # see the loop's last kernels, whichever stream ran them
    return Snapshot(entries, tensors, sum(t.numel() * t.element_size() for t in tensors), ends)


class Emergency:
    """What outlives one emergency save: the pinned chunks (CUDA) and the measured bandwidth.

    :attr:`bandwidth` (bytes/s, notice to committed) is the last emergency save's; until one ran it
    is seeded by the periodic saves' persist bandwidth (:meth:`seed`), which is lower (CPU-capped and
    reniced), so the first estimate errs on the side of skipping a save."""

    def __init__(self) -> None:
        self.bandwidth: float | None = None
        self.measured = False
        """True once an emergency save set :attr:`bandwidth` (seeds no longer apply)."""
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._allocated = 0
        self._lock = threading.Lock()

    def seconds(self, nbytes: int) -> float:
        """Expected notice-to-committed seconds of an emergency save of ``nbytes``."""
        return nbytes / (self.bandwidth or ASSUMED_THROUGHPUT)

    def seed(self, nbytes: int, seconds: float) -> None:
        """A periodic save persisted ``nbytes`` in ``seconds``: the estimate until a measurement."""
        if not self.measured and nbytes and seconds > 0:
            self.bandwidth = nbytes / seconds

    def observe(self, nbytes: int, seconds: float) -> None:
        """An emergency save committed ``nbytes`` in ``seconds``."""
        if nbytes and seconds > 0:
            self.bandwidth, self.measured = nbytes / seconds, True

    def writer(self) -> LiveWriter:
        return LiveWriter(self)

    def take_chunks(self) -> list[torch.Tensor]:
        """A pair of pinned chunks; at most one pair per write thread is ever allocated."""
        with self._lock:
            if self._chunks.empty() and self._allocated < WRITE_THREADS:
                self._allocated += 1
                return [torch.empty(STREAM_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        return self._chunks.get()

    def give_chunks(self, chunks: list[torch.Tensor]) -> None:
        self._chunks.put(chunks)


class _File:
    """One file written by several threads; the thread that writes its last segment fsyncs and
    closes it, and :attr:`done` then holds the outcome."""

    def __init__(self, fd: int, segments: int) -> None:
        self.fd, self.left, self.error = fd, segments, None
        self.lock = threading.Lock()
        self.done: Future[None] = Future()

    def write(self, view: memoryview, offset: int) -> None:
        self.run(_write_segment, self.fd, view, offset)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One segment's work (skipped once another failed); an error is kept for :attr:`done`."""
        try:
            return fn(*args) if self.error is None else None
        except BaseException as exc:
            self.error = self.error or exc
            raise
        finally:
            with self.lock:
                self.left -= 1
                last = self.left == 0
            if last:
                self._close()

    def _close(self) -> None:
        try:
            if self.error is None:
                os.fsync(self.fd)
        except BaseException as exc:
            self.error = exc
        finally:
            os.close(self.fd)
        if self.error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(self.error)


def _write_segment(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + _fs.CHUNK_BYTES], offset + done)
    _fs.start_writeback(fd)  # the disk starts on it while the next segments are written


class LiveWriter(_Writer):
    """The emergency writer of :func:`~.commit.write_part`: the same files, written in parallel
    from live memory; :meth:`finish` (inherited) waits for every write, fsync and hash."""

    def __init__(self, emergency: Emergency) -> None:  # its own pools; the rest is inherited
        self.emergency = emergency
        self.syncer = Workers(WRITE_THREADS, "spotguard-emergency-write")  # writes, then fsyncs
        self.hashers = Workers(2, "spotguard-emergency-hash")
        self.pools = (self.syncer, self.hashers)
        self.pending: list[tuple[str, int, Future[str], Future[None]]] = []

    def write(self, directory: Path, relpath: str, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        offsets = range(0, max(len(view), 1), SEGMENT_BYTES)
        file = _File(_fs.open_new(directory / relpath), len(offsets))
        digest = self.hashers.submit(_fs.digests_of, view)
        for offset in offsets:
            self.syncer.submit(file.write, view[offset : offset + SEGMENT_BYTES], offset)
        self.pending.append((relpath, len(view), digest, file.done))

    def _wait(self, written: Future[None]) -> None:
        written.result()  # a file's done: every segment written, then fsynced

    def write_tensor(self, directory: Path, relpath: str, t: torch.Tensor) -> None:
        if not t.is_cuda:
            return super().write_tensor(directory, relpath, t)
        file = _File(_fs.open_new(directory / relpath), 1)
        digest = self.syncer.submit(file.run, self._stream, file.fd, t)
        self.pending.append((relpath, t.numel() * t.element_size(), digest, file.done))

    def _stream(self, fd: int, t: torch.Tensor) -> dict[str, Any]:
        chunks = self.emergency.take_chunks()
        try:
            return stream_tensor(fd, t, chunks)
        finally:
            self.emergency.give_chunks(chunks)


def stream_tensor(fd: int, src: torch.Tensor, chunks: list[torch.Tensor]) -> dict[str, Any]:
    """Write the bytes of ``src`` to ``fd`` through the two CPU ``chunks`` (pinned for CUDA), the
    copy of the next chunk overlapping the hashing and writing of this one; returns the file's
    digests, the same manifest entry as a periodic save's (:func:`._fs.digests_of`)."""
    flat = src.detach().reshape(-1).view(torch.uint8)
    copier, size, digests = _Copier(src), chunks[0].numel(), _fs.Digests()
    ready = copier.start(chunks[0], flat[:size])
    for k, offset in enumerate(range(0, flat.numel(), size)):
        piece = chunks[k % 2][: min(size, flat.numel() - offset)]
        copier.wait(ready)
        if offset + size < flat.numel():
            ready = copier.start(chunks[(k + 1) % 2], flat[offset + size : offset + 2 * size])
        view = memoryview(piece.numpy())
        digests.update(view)
        _fs.write_all(fd, view)
    return digests.entry()


class _Copier:
    """Chunk copies on a side stream that first waits for the work already queued (CUDA), or
    plain synchronous copies (CPU sources: the same pipeline, testable without a GPU)."""

    def __init__(self, src: torch.Tensor) -> None:
        self.stream = None
        if src.is_cuda:
            self.stream = torch.cuda.Stream(src.device)
            self.stream.wait_stream(torch.cuda.current_stream(src.device))

    def start(self, out: torch.Tensor, piece: torch.Tensor) -> Any:
        if self.stream is None:
            out[: piece.numel()].copy_(piece)
            return None
        with torch.cuda.stream(self.stream):
            out[: piece.numel()].copy_(piece, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    @staticmethod
    def wait(event: Any) -> None:
        if event is not None:
            event.synchronize()
