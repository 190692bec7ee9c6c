"""Write a snapshot into a directory and commit it atomically (the crash-safe half of a save).

Protocol (a SIGKILL at any instant leaves the previous checkpoint loadable)::

    mkdir .tmp-step-N-<pid>/ -> write + fsync every data file -> write + fsync manifest.json (last)
    -> fsync the tmp dir -> rename to step-N/ -> fsync root -> latest.tmp + fsync -> replace latest
    -> fsync root -> only then (the Checkpointer, once the commit is reported) delete checkpoints
    beyond ``keep``

Large tensors (``>= large_bytes``) get a file each, written straight from the staging buffer, so an
unchanged tensor produces a byte-identical file (same sha256: the uploader skips it). Small tensors
are packed, 64-byte aligned, into ``small.bin`` (the stager keeps them there already: see
``Snapshot.packed``, written as it is); the structure goes to ``tree.json``; the DTensors of
sharded entries go to ``dcp/`` through ``torch.distributed.checkpoint`` (see :mod:`.sharded`). sha256 runs in
a thread pool beside the writes; large files are written ``O_DIRECT`` from the page-aligned staging
buffers (see :func:`._fs.write_all`), two at a time, and fsynced in one more thread in the order written.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import xxhash

from spotguard._forkgate import torch_work
from spotguard.checkpoint import _fs
from spotguard.checkpoint._workers import Throttle, Workers
from spotguard.checkpoint.errors import CheckpointDiskFullError, CheckpointError
from spotguard.checkpoint.layout import (VOLATILE, CommitInfo, MANIFEST, committed_dirs, remove_checkpoint,
                                         step_name)
from spotguard.checkpoint.layout import remove_own_trash, tmp_name, write_latest
from spotguard.checkpoint.staging import SMALL, Snapshot, layout

__all__ = ["FORMAT", "VERSION", "TREE", "tensor_bytes", "write_part", "part_digest", "write_manifest", "publish",
           "apply_retention", "persist_local"]

FORMAT = "spotguard-checkpoint"
VERSION = 1
TREE = "tree.json"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor as a flat memoryview; a contiguous CPU tensor's own memory, not a copy.
    (No detach or copy where none is needed: 60,000 small tensors are 60,000 calls.)"""
    with torch_work():  # a periodic save's persist thread calls this: no fork cuts through it
        if t.requires_grad:
            t = t.detach()
        if not t.is_cpu:
            t = t.cpu()
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Writer:
    """Writes files in a pool of writer threads (two uncapped: the disk works on two files at once,
    measured 1.3x one at a time with ``O_DIRECT``), fsyncs them in one more thread in the order
    written (an fsync commits the metadata of every file written before it in one journal commit:
    the later fsyncs find little to do), and hashes them in a third pool. The emergency path's
    :class:`~.emergency.LiveWriter` is a variant with pools of its own."""

    def __init__(self, nice: int | None, throttle: Throttle | None) -> None:
        # A fixed cap: one writer and one hasher share it. Uncapped or adaptive (the budget may grow
        # to the disk's speed, see ._budget): two of each keep up with the disk.
        threads = 1 if throttle and throttle.share and not throttle.adaptive else 2
        self.hashers = Workers(threads, "spotguard-ckpt-hash", nice)
        self.writers = Workers(threads, "spotguard-ckpt-write", nice)
        self.syncer = Workers(1, "spotguard-ckpt-fsync", nice)
        self.pace = throttle.run if throttle else None
        self.pools = (self.hashers, self.writers, self.syncer)
        self.pending: list[tuple[str, int, Future[Any], Future[Any]]] = []

    def write(self, directory: Path, relpath: str, data: memoryview) -> None:
        fd = _fs.open_new(directory / relpath)
        digest = self.hashers.submit(_fs.digests_of, data, self.pace)
        self.pending.append((relpath, len(data), digest, self.writers.submit(self._write, fd, data)))

    def _write(self, fd: int, data: memoryview) -> Future[None]:
        try:
            _fs.write_all(fd, data, self.pace)
        except BaseException:
            os.close(fd)
            raise
        return self.syncer.submit(_fsync_close, fd)

    def write_tensor(self, directory: Path, relpath: str, t: torch.Tensor) -> None:
        self.write(directory, relpath, tensor_bytes(t))

    def finish(self) -> dict[str, dict[str, Any]]:
        """Wait for every hash and fsync; the first failure (e.g. ENOSPC on fsync) is raised."""
        try:
            futures.wait([written for *_, written in self.pending])  # every fsync queued before shutdown
            files = {}
            for relpath, size, digest, written in self.pending:
                self._wait(written)
                files[relpath] = _entry(size, digest.result())
            return files
        finally:
            for pool in self.pools:
                pool.shutdown()

    def _wait(self, written: Future[Future[None]]) -> None:
        written.result().result()  # the write, then the fsync it queued

    def abort(self) -> None:
        try:
            self.finish()
        except Exception:  # the write error that led here is the one worth raising
            pass


def _entry(size: int, digests: dict[str, Any]) -> dict[str, Any]:
    """A manifest entry: ``{size, sha256, xxh3, xxh3_chunk}`` (:func:`._fs.digests_of`)."""
    return {"size": size, **digests}


def _fsync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_part(dest: Path, snap: Snapshot, *, large_bytes: int, nice: int | None,
               throttle: Throttle | None = None, writer: _Writer | None = None) -> tuple[dict[str, dict], str]:
    """Write ``snap`` under ``dest`` (created); returns ``{relpath: {size, sha256, xxh3...}}`` and the part's
    :func:`part_digest`. ``nice`` applies to the writer, hashing and fsync threads, ``throttle`` to
    writing and hashing; an emergency save passes its ``writer`` (see :mod:`.emergency`), same files."""
    packed = getattr(snap, "packed", None)
    if packed is not None and (packed.large_bytes != large_bytes or len(packed.index) != len(snap.tensors)):
        packed = None  # staged for another threshold: lay it out here
    index, small_size = (packed.index, packed.size) if packed is not None else layout(snap.tensors, large_bytes)
    _fs.mkdir_private(dest)
    writer = writer or _Writer(nice, throttle)
    try:
        large = [(entry["file"], t) for entry, t in zip(index, snap.tensors) if entry["file"] != SMALL]
        if large:
            _fs.mkdir_private(dest / "tensors")
        for file, t in large:
            writer.write_tensor(dest, file, t)
        small = None
        if packed is not None:  # the small tensors were staged into small.bin as it is
            small = tensor_bytes(packed.arena)
            writer.write(dest, SMALL, small)
        elif small_size or any(e["file"] == SMALL for e in index):
            small = memoryview(_pack_small(index, snap.tensors, small_size))
            writer.write(dest, SMALL, small)
        tensors = packed.index_json if packed is not None else _json(index)
        encoded = [_json(entry) for entry in snap.entries]  # once: the tree and the digest both need them
        tree = '{"entries":[' + ",".join(encoded) + '],"tensors":' + tensors + "}"
        writer.write(dest, TREE, memoryview(tree.encode()))
    except BaseException:
        writer.abort()
        raise
    files = writer.finish()
    if getattr(snap, "dtensors", None):  # sharded entries (see .sharded): DCP files beside ours
        from spotguard.checkpoint.sharded import write_dcp

        files.update(write_dcp(dest, snap, throttle))
    for sub in (dest / "tensors", dest):
        if sub.is_dir():
            _fs.fsync_dir(sub)
    return files, part_digest(snap, index, files, small, encoded)


def part_digest(snap: Snapshot, index: list[dict[str, Any]], files: dict[str, dict],
                small: memoryview | None, encoded: list[str]) -> str:
    """sha256 of a part's training state: each entry's structure (its tree, its tensors' index
    entries) and its tensors' bytes, in order, entries in :data:`~.layout.VOLATILE` excluded.

    Large tensors are hashed already (a file each: their sha256 goes in). An entry's small tensors
    sit in order in one run of ``small`` (small.bin as written; alignment gaps are zeros; None
    when the part has none), so that run goes in whole, as its XXH3-128: one call per entry, where
    a sha256 per small tensor was 0.3 s of Python for 80,000 of them. The layout is a function of
    the tensors and the threshold, so equal states give equal digests. DCP files of sharded entries
    count whole. ``encoded``: the entries' JSON, as tree.json has them."""
    sha, start = hashlib.sha256(), 0
    packed = getattr(snap, "packed", None)
    runs = packed.runs_json if packed is not None and packed.index is index else {}
    for entry_json, (name, _, _), end in zip(encoded, snap.entries, snap.ends):
        if name not in VOLATILE:
            mine = index[start:end]
            if (start, end) not in runs:
                runs[start, end] = _json(mine)
            sha.update(f"{entry_json}\n{runs[start, end]}\n".encode())
            for entry in mine:
                if entry["file"] != SMALL:
                    sha.update(files[entry["file"]]["sha256"].encode())
            run = _small_run(mine)
            if run is not None:  # XXH3 (16 GB/s here): small.bin's sha256 is taken by the writer already
                sha.update(xxhash.xxh3_128_digest(small[run[0] : run[1]]))
        start = end
    for relpath in sorted(k for k in files if k.startswith("dcp/")):
        sha.update(f"{relpath}{files[relpath]['sha256']}".encode())
    return sha.hexdigest()


def _small_run(entries: list[dict[str, Any]]) -> tuple[int, int] | None:
    """``[first, end)`` of small.bin holding the small tensors of ``entries`` (in layout order)."""
    first = next((e for e in entries if e["file"] == SMALL), None)
    if first is None:
        return None
    last = next(e for e in reversed(entries) if e["file"] == SMALL)
    return first["offset"], last["offset"] + last["nbytes"]


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _pack_small(index: list[dict[str, Any]], tensors: list[torch.Tensor], size: int) -> bytearray:
    buf = bytearray(size)
    with torch_work():  # one piece, not one per small tensor
        for entry, t in zip(index, tensors):
            if entry["file"] == SMALL and entry["nbytes"]:
                buf[entry["offset"] : entry["offset"] + entry["nbytes"]] = tensor_bytes(t)
    return buf


def write_manifest(tmp: Path, meta: dict[str, Any], files: dict[str, dict]) -> None:
    """Write manifest.json, the last file of a checkpoint, and fsync the directory."""
    manifest = {"format": FORMAT, "version": VERSION, **meta, "files": dict(sorted(files.items()))}
    _fs.write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fs.fsync_dir(tmp)


def publish(root: Path, tmp: Path, step: int) -> Path:
    """Rename ``tmp`` to ``step-N`` (replacing an older directory of the same step) and point latest."""
    final = root / step_name(step)
    if final.exists():
        remove_checkpoint(root, final)
    os.rename(tmp, final)
    _fs.fsync_dir(root)
    write_latest(root, final.name)
    return final


def apply_retention(root: Path, keep: int, newest: Path | None = None,
                    stop: Callable[[], bool] | None = None) -> list[Path]:
    """Delete committed checkpoints beyond the newest ``keep``; never ``newest`` itself. Once
    ``stop()`` is true, what is left of a deletion stays hidden in a trash directory, for the next
    call (:func:`.layout.remove_own_trash`) or the next process (:func:`.layout.remove_stale`)."""
    if not remove_own_trash(root, stop):
        return []
    doomed = [p for _, p in committed_dirs(root)[max(keep, 1) :] if p != newest]
    for path in doomed:
        if (stop is not None and stop()) or not remove_checkpoint(root, path, stop):
            break
    return doomed


def persist_local(root: Path, snap: Snapshot, meta: dict[str, Any], *, large_bytes: int,
                  nice: int | None, throttle: Throttle | None = None, writer: _Writer | None = None) -> CommitInfo:
    """The whole single-process save: write to a tmp dir and commit (retention is the caller's,
    once the commit is reported: see :meth:`.Checkpointer._apply_retention`)."""
    tmp = root / tmp_name(meta["step"], os.getpid())
    try:
        _fs.mkdir_private(tmp)
        files, digest = write_part(tmp / "rank-0", snap, large_bytes=large_bytes, nice=nice,
                                   throttle=throttle, writer=writer)
        files = {f"rank-0/{k}": v for k, v in files.items()}
        meta = {**meta, "digest": digest}
        write_manifest(tmp, meta, files)
        final = publish(root, tmp, meta["step"])
    except BaseException as exc:
        _fs.remove_tree(tmp)
        translated = translate_error(exc, root, snap.nbytes)
        if translated is exc:
            raise
        raise translated from exc
    return commit_info(final, meta, files)


def translate_error(exc: BaseException, root: Path, nbytes: int) -> BaseException:
    if _fs.is_enospc(exc):
        return CheckpointDiskFullError(root, nbytes, _fs.free_bytes(root))
    if isinstance(exc, OSError):
        return CheckpointError(f"saving a checkpoint under {root} failed: {exc}")
    return exc


def commit_info(final: Path, meta: dict[str, Any], files: dict[str, dict]) -> CommitInfo:
    size = sum(f["size"] for f in files.values()) + (final / MANIFEST).stat().st_size
    return CommitInfo(meta["step"], meta.get("epoch"), final, size, len(files) + 1, meta["created"],
                      meta.get("digest", ""))
