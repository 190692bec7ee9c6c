"""Verify and read a committed checkpoint, then restore it into a live state in place.

Verification before anything is restored: the manifest parses and names this format; every listed
file is a regular file (no symlink) inside the checkpoint, has an allowed name (``.bin``/``.json``,
or DCP's ``.metadata``/``__r_i.distcp`` in a part's ``dcp/``, whose pickle :mod:`.sharded` reads
restricted: nothing is unpickled freely) and the listed size; with ``verify`` the check of each of
its chunks (XXH3, or crc32 in checkpoints written just before it) matches the manifest's, computed by
the thread that read the chunk while others read the next ones, or, for a file listed without them
(older checkpoints, DCP's), its sha256. Only then are
values decoded and handed to ``load_state_dict`` / ``copy_``, so a corrupt checkpoint never
half-overwrites a live state. The sha256 stays the content address of buckets (the daemon's uploads
and :mod:`spotguard.storage` check it); the local restore needs integrity only, at the disk's speed.

Large files are read (``O_DIRECT`` where the file system takes it, :class:`._fs.FileReader`) into
page-aligned buffers that the Checkpointer then adopts as its staging buffers (:meth:`.Stager.adopt`):
a restore costs one copy of the state, not two. Into the huge pages of a buffer the disk reads
directly; into its other pages through a bounce buffer of one huge page per reading thread (see
:meth:`_PartReader._span`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from spotguard.checkpoint import _fs, _hugepages
from spotguard.checkpoint._workers import Workers
from spotguard.checkpoint.commit import FORMAT, SMALL, TREE, VERSION
from spotguard.checkpoint.errors import CheckpointCorruptError, CheckpointError
from spotguard.checkpoint.format import decode, dtype_from_name
from spotguard.checkpoint.layout import MANIFEST, CommitInfo
from spotguard.checkpoint.staging import aligned_bytes

__all__ = ["read_manifest", "check", "read_entries", "restore"]

logger = logging.getLogger(__name__)
_SUFFIXES = (".bin", ".json")
READERS = 8
"""Spans (:data:`._fs.CHUNK_BYTES`) read and checked at once: enough to keep a disk's queue busy
while other readers copy out of their bounce buffers or check what they read (1 GiB here: 0.49 s
with 8, 0.515 s with 4, median of 4 fresh processes each)."""
_DCP_NAMES = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")  # DCP's files, only in a part's dcp/


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of ``path`` after structural checks (files present, sizes right, safe names)."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path}: unreadable manifest: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorruptError(f"{path}: unsupported manifest version {manifest.get('version')!r}")
    for relpath, meta in manifest["files"].items():
        _check_file(path, relpath, meta)
    return manifest


def _check_file(path: Path, relpath: str, meta: Any) -> None:
    rel = PurePosixPath(relpath)
    dcp_file = len(rel.parts) == 3 and rel.parts[1] == "dcp" and _DCP_NAMES.match(rel.name)
    allowed = rel.suffix in _SUFFIXES or dcp_file
    if rel.is_absolute() or ".." in rel.parts or not allowed or rel.name == MANIFEST:
        raise CheckpointCorruptError(f"{path}: refusing file {relpath!r} (only .bin/.json and DCP's files)")
    try:
        st = os.lstat(path / rel)
    except OSError:
        raise CheckpointCorruptError(f"{path}: missing file {relpath}") from None
    if not os.path.isfile(path / rel) or os.path.islink(path / rel):
        raise CheckpointCorruptError(f"{path}: {relpath} is not a regular file")
    if not isinstance(meta, dict) or st.st_size != meta.get("size"):
        raise CheckpointCorruptError(f"{path}: {relpath} has {st.st_size} bytes, manifest says {meta}")


def check(path: Path) -> CommitInfo:
    """Cheap validity check (manifest, names, sizes; no hashing) and the checkpoint's CommitInfo."""
    m = read_manifest(path)
    size = sum(f["size"] for f in m["files"].values()) + (path / MANIFEST).stat().st_size
    digest = m.get("digest") if isinstance(m.get("digest"), str) else ""
    return CommitInfo(int(m["step"]), m.get("epoch"), path, size, len(m["files"]) + 1, float(m["created"]),
                      digest)


def read_entries(path: Path, manifest: dict[str, Any], part: str, *, verify: bool,
                 buffers: list[torch.Tensor | None] | None = None) -> dict[str, Any]:
    """``{name: (kind, value)}`` of one part (``rank-<r>``), every byte read checked first. With
    ``buffers`` (a list), it receives ``(tensor, entry name)`` for each snapshot position that has a
    file of its own (None for the packed ones): for :meth:`.Stager.adopt`."""
    try:
        with Workers(READERS, "spotguard-ckpt-read") as pool:
            reader = _PartReader(path, manifest["files"], part, pool, verify)
            tree = json.loads(reader.read_file(TREE).numpy().tobytes())
            tensors = reader.tensors(tree["tensors"])
            reader.check_hashes()
        owners: dict[int, str] = {}

        def tensor_of(name: str, i: int) -> torch.Tensor:
            owners[i] = name
            return tensors[i]
        entries = {name: (kind, decode(value, lambda i, n=name: tensor_of(n, i)))
                   for name, kind, value in tree["entries"]}
        if buffers is not None:
            buffers[:] = [(t, owners.get(i)) if e["file"] != SMALL else None
                          for i, (e, t) in enumerate(zip(tree["tensors"], tensors))]
        return entries
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointCorruptError(f"{path}: malformed tree: {exc!r}") from exc


class _PartReader:
    """Reads a part's files into page-aligned buffers, :data:`READERS` spans at a time across files,
    and checks each span in the thread that read it (both release the GIL), so reading and
    verification overlap and several requests stay in flight. A file listed without chunk checks
    (older checkpoints) is checked by its sha256 once it is read."""

    def __init__(self, path: Path, files: dict, part: str, pool: Workers, verify: bool) -> None:
        self.path, self.files, self.part, self.pool, self.verify = path, files, part, pool, verify
        self.sha256s: list[tuple[str, Any, Future[Any]]] = []
        """(relpath, expected, computed) of the files checked by their sha256."""
        self.cache: dict[str, torch.Tensor] = {}
        self.failed = False
        """A span failed: the others still queued skip their reads."""
        self.bounces: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        """Bounce buffers (:func:`._hugepages.bounce_buffer`) not in use, at most one per reader;
        a None there: huge pages may not be asked for."""

    def read_file(self, name: str) -> torch.Tensor:
        self.read_files([name])
        return self.cache[f"{self.part}/{name}"]

    def read_files(self, names: list[str]) -> None:
        spans: list[Future[None]] = []
        readers: list[_fs.FileReader] = []
        legacy: list[tuple[str, Any, memoryview]] = []
        try:
            for name in dict.fromkeys(names):
                rel = f"{self.part}/{name}"
                if rel not in self.files:
                    raise CheckpointCorruptError(f"{self.path}: {rel} is not listed in the manifest")
                if rel not in self.cache:
                    spans += self._submit(rel, self.files[rel], readers, legacy)
            for span in spans:
                span.result()
        except (OSError, EOFError) as exc:
            raise CheckpointCorruptError(f"{self.path}: cannot read: {exc}") from exc
        finally:
            self.failed = any(not s.done() or s.exception() for s in spans)  # the rest skip their reads
            for span in spans:  # none may still write into a buffer once this returns or raises
                span.exception()
            for reader in readers:
                reader.close()
        self.sha256s += [(rel, expected, self.pool.submit(_fs.sha256_of, view)) for rel, expected, view in legacy]

    def _submit(self, rel: str, meta: dict[str, Any], readers: list[_fs.FileReader],
                legacy: list[tuple[str, Any, memoryview]]) -> list[Future[None]]:
        buf = aligned_bytes(meta["size"])
        check = _chunk_check(meta) if self.verify else None
        name, values, chunk = check if check is not None else ("", None, _fs.CHUNK_BYTES)
        if values is not None and len(values) != -(-meta["size"] // chunk):
            raise CheckpointCorruptError(f"{self.path}: {rel} lists {len(values)} {name} chunks for {meta['size']} bytes")
        readers.append(reader := _fs.FileReader(self.path / rel))
        view = memoryview(buf.numpy())
        self.cache[rel] = buf
        if self.verify and values is None:
            legacy.append((rel, meta.get("sha256"), view))
        huge = _hugepages.huge_range(buf)
        return [self.pool.submit(self._span, reader, rel, view, offset, min(offset + chunk, meta["size"]),
                                 (name, values[offset // chunk]) if values is not None else None, huge)
                for offset in range(0, meta["size"], chunk)]

    def _span(self, reader: _fs.FileReader, rel: str, view: memoryview, start: int, end: int,
              expected: tuple[str, int] | None, huge: tuple[int, int]) -> None:
        """Read and check ``view[start:end]``. Into ``view``'s huge pages (``huge``, the offsets
        they span) the disk reads directly; into 2 MiB or more of other memory through a bounce
        buffer, since an ``O_DIRECT`` request ends at every physical discontinuity of the memory read
        into, and fresh 4 KiB pages cut a read into requests of 0.5-1.5 MiB where the disk takes
        4 MiB (benchmarks/README.md, "Bounce buffers"). Only from a block device: from tmpfs an
        ``O_DIRECT`` read is a copy already, and a network file system sizes its own requests."""
        if self.failed:
            return
        cuts = sorted({start, end} | {x for x in huge if start < x < end})
        bounce = None
        try:
            for a, b in zip(cuts, cuts[1:]):
                inside = huge[0] <= a and b <= huge[1]
                if bounce is None and not inside and b - a >= _hugepages.HUGE and reader.direct and reader.block:
                    bounce = self._bounce()
                reader.read(view, a, b, None if inside else bounce)
        finally:
            if bounce is not None:
                self.bounces.put(bounce)
        if expected is not None and _fs.CHUNK_CHECKS[expected[0]](view[start:end]) != expected[1]:
            raise CheckpointCorruptError(f"{self.path}: {expected[0]} of bytes {start}+ mismatch in {rel}")

    def _bounce(self) -> memoryview | None:
        try:
            bounce = self.bounces.get_nowait()
        except queue.Empty:
            made = _hugepages.bounce_buffer()
            if made is not None:
                return memoryview(made.numpy())
            bounce = None
        if bounce is None:
            self.bounces.put(None)  # no huge pages: every reader learns it from here
        return bounce

    def tensors(self, index: list[dict[str, Any]]) -> list[torch.Tensor]:
        self.read_files([e["file"] for e in index])
        return [self._tensor(e) for e in index]

    def _tensor(self, e: dict[str, Any]) -> torch.Tensor:
        dtype, shape, offset, nbytes = dtype_from_name(e["dtype"]), e["shape"], e["offset"], e["nbytes"]
        raw = self.read_file(e["file"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(shape) * itemsize != nbytes or offset < 0 or offset + nbytes > raw.numel():
            raise CheckpointCorruptError(f"{self.path}: tensor entry {e} does not fit its file")
        t = raw[offset : offset + nbytes].view(dtype).reshape(shape)
        # A packed tensor gets storage of its own: some consumers (Generator.set_state) ignore offsets.
        return t if nbytes == raw.numel() else t.clone()

    def check_hashes(self) -> None:
        for rel, expected, digest in self.sha256s:
            if digest.result() != expected:
                raise CheckpointCorruptError(f"{self.path}: sha256 mismatch in {rel}")


def _chunk_check(meta: dict[str, Any]) -> tuple[str, list[int], int] | None:
    """The per-chunk check a manifest entry lists, the preferred one where it has several: its name,
    values and chunk size; None without a usable one (then its sha256 is checked)."""
    for name in _fs.CHUNK_CHECKS:
        values, chunk = meta.get(name), meta.get(f"{name}_chunk")
        if isinstance(values, list) and type(chunk) is int and 4096 <= chunk <= 1 << 30:
            return name, values, chunk
    return None


def restore(state: Mapping[str, Any], entries: dict[str, tuple[str, Any]]) -> None:
    """Put saved values into ``state`` in place: load_state_dict, tensor copy_, mapping update."""
    for name in state.keys() - entries.keys():
        logger.warning("checkpoint has no entry %r; it keeps its current value", name)
    for name in entries.keys() - state.keys():
        logger.warning("checkpoint entry %r has no place in the state; ignored", name)
    try:
        for name in state.keys() & entries.keys():
            _restore_entry(state, name, entries[name][1])
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"restoring checkpoint entry failed: {exc}") from exc


def _restore_entry(state: Mapping[str, Any], name: str, value: Any) -> None:
    target = state[name]
    if isinstance(target, torch.optim.Optimizer):
        target.load_state_dict(_indexed_groups(value))
    elif hasattr(target, "load_state_dict"):
        target.load_state_dict(value)
    elif isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
        with torch.no_grad():
            target.copy_(value)
    elif isinstance(target, MutableMapping) and isinstance(value, Mapping):
        _update_mapping(target, value)
    elif isinstance(state, MutableMapping):
        state[name] = value
    else:
        raise CheckpointError(f"cannot restore entry {name!r} in place: the state is read-only")


class _ParamIds(list):
    """A saved parameter group's ids, a list that answers ``in`` from a set. torch's
    ``Optimizer.load_state_dict`` looks each state tensor's id up in its group's list (torch 2.13,
    ``_process_value_according_to_param_policy``): quadratic, 3.6 s of a 20,000-parameter AdamW's
    restore here, where this makes it 0.1 s."""

    def __contains__(self, item: object) -> bool:
        ids = self.__dict__.get("_ids")
        if ids is None:
            ids = self.__dict__["_ids"] = frozenset(self)
        try:
            return item in ids
        except TypeError:  # unhashable: a list compares it with each item
            return list.__contains__(self, item)


def _forgetting(method: Any) -> Any:
    def changed(self: _ParamIds, *args: Any, **kwargs: Any) -> Any:
        self.__dict__.pop("_ids", None)
        return method(self, *args, **kwargs)
    return changed


for _name in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse", "__setitem__", "__delitem__",
              "__iadd__", "__imul__"):
    setattr(_ParamIds, _name, _forgetting(getattr(list, _name)))


def _indexed_groups(value: Any) -> Any:
    """An optimizer's state dict with each group's ``params`` a :class:`_ParamIds` (the rest as is)."""
    groups = value.get("param_groups") if isinstance(value, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list)
                                               and all(type(i) is int for i in g["params"]) for g in groups):
        return value
    return {**value, "param_groups": [{**g, "params": _ParamIds(g["params"])} for g in groups]}


def _update_mapping(target: MutableMapping, value: Mapping) -> None:
    for key, new in value.items():
        old = target.get(key)
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and _same_kind(old, new):
            with torch.no_grad():
                old.copy_(new)
        elif isinstance(old, MutableMapping) and isinstance(new, Mapping):
            _update_mapping(old, new)
        else:
            target[key] = new


def _same_kind(old: torch.Tensor, new: torch.Tensor) -> bool:
    return old.shape == new.shape and old.dtype == new.dtype
