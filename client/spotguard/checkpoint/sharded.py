"""Sharded state (FSDP2 / DTensor) through ``torch.distributed.checkpoint``, without trusting pickle.

An entry whose ``state_dict()`` holds DTensors is split at snapshot time: its structure and plain
values go through the JSON tree like any entry (kind ``"sharded"``, value ``{"tree", "dcp"}``, the
tree holding ``None`` where a DTensor was and ``dcp`` listing those key paths), while each DTensor's
local shard is copied into a reusable staging buffer (the only part the loop waits for) and
re-wrapped as a DTensor with the same mesh and placements. The background save then writes them
with ``dcp.save(no_dist=True)`` into ``rank-<r>/dcp/`` of the engine's tmp dir, hashes each file
into the rank's part, and the usual commit protocol (manifest with every rank's sizes and sha256,
rank 0 renames) applies. ``no_dist`` because DCP's planning collectives (``gather_object``) unpickle
what crosses the wire: each rank writes its own metadata and shards.

A load on the same world size reads its own part. A load on another world size (elastic resume)
reshards: each rank reads every part's ``.metadata`` through the same restrictive reader, merges
them into one (each chunk's file renamed ``rank-<r>/dcp/<file>``, relative to the checkpoint) and
lets DCP's planner, still ``no_dist``, plan the reads of its own new shards from the overlapping
saved chunks; no collective and no unpickling from another rank.

Loading verifies the sha256 of every ``dcp/`` file against the manifest, then reads through
:class:`SafeFileSystemReader`: the ``.metadata`` pickle is unpickled by :class:`_MetadataUnpickler`,
which resolves only DCP's metadata dataclasses, ``torch.Size``, torch dtypes/layouts and plain
builtins (anything else is a :class:`CheckpointCorruptError`, so a crafted pickle never runs);
metadata naming a file outside the verified set, or a non-tensor (``BYTE_IO``) item, which DCP
would ``torch.load(weights_only=False)``, is refused; tensor payloads are ``torch.load(...,
weights_only=True)`` by DCP itself. Shards load into fresh DTensors shaped like the live state's,
so a failing load never touches the model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.tensor import DTensor

from spotguard._forkgate import torch_work
from spotguard.checkpoint import _fs
from spotguard.checkpoint._workers import Throttle
from spotguard.checkpoint.errors import CheckpointCorruptError, CheckpointError
from spotguard.checkpoint.staging import Snapshot

__all__ = ["SHARDED", "DCP_DIR", "ShardedSnapshot", "ShardStager", "SafeFileSystemReader", "mark",
           "write_dcp", "load_entries"]

SHARDED = "sharded"
DCP_DIR = "dcp"
_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool",
             "complex"}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_CLASSES = {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING", "_StorageInfo"}
_ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}
"""Found by unpickling real FSDP2 metadata with a recording ``find_class``; the rest are harmless
siblings (set, OrderedDict, BytesStorageMetadata) a future DCP may emit."""


@dataclass
class ShardedSnapshot(Snapshot):
    """A :class:`Snapshot` plus the staged DTensors of its sharded entries, keyed ``<entry>/<i>``."""

    dtensors: dict[str, DTensor] = field(default_factory=dict)


class ShardStager:
    """Splits sharded entries off a state and stages their local shards in reusable CPU buffers
    (pinned when CUDA is available), as :class:`~.staging.Stager` does for plain tensors."""

    def __init__(self) -> None:
        self._pin = torch.cuda.is_available()
        self._buffers: dict[str, torch.Tensor] = {}

    def split(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, DTensor]]:
        """``(plain, dtensors)``: ``plain`` is ``state`` with each sharded entry replaced by its
        ``{"tree", "dcp"}`` skeleton and each stateful one by its state_dict (taken once here)."""
        plain, staged = dict(state), {}
        for name, value in state.items():
            stateful = hasattr(value, "state_dict") and hasattr(value, "load_state_dict")
            tree = value.state_dict() if stateful else value
            found: list[tuple[list[Any], DTensor]] = []
            _find(tree, [], found)
            if found:
                plain[name] = {"tree": _strip(tree, [], []), "dcp": [p for p, _ in found]}
                for i, (_, t) in enumerate(found):
                    staged[f"{name}/{i}"] = self._stage(f"{name}/{i}", t)
            elif stateful:
                plain[name] = tree
        if any(t.to_local().is_pinned() for t in staged.values()):
            torch.cuda.synchronize()  # the device-to-host copies were asynchronous
        return plain, staged

    def _stage(self, key: str, t: DTensor) -> DTensor:
        """A CPU copy of ``t``'s local shard, wrapped with ``t``'s own spec (mesh, placements,
        global shape): ``DTensor.from_local`` would move it back to the mesh's device."""
        local = t.to_local()
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != local.dtype or buf.shape != local.shape:
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=self._pin and local.is_cuda)
            self._buffers[key] = buf
        buf.copy_(local.detach(), non_blocking=local.is_cuda)
        return DTensor(buf, t._spec, requires_grad=False)  # as torch's own _copy_state_dict does

    def release(self) -> None:
        self._buffers = {}


_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, str, bool, type(None)})
"""Types a tree's leaves have when they hold no DTensor: :func:`_find` passes them at once."""


def _find(tree: Any, path: list[Any], found: list[tuple[list[Any], DTensor]]) -> None:
    """Append the key path of every DTensor in ``tree`` to ``found``; builds nothing, so a state
    with none (every save once AdamW imported DTensor: 60,000 tensors took 0.45 s) costs one walk."""
    kind = type(tree)
    if kind in _LEAVES:
        return
    if isinstance(tree, DTensor):
        found.append((list(path), tree))
    elif kind is dict or isinstance(tree, Mapping):
        for key, value in tree.items():
            path.append(key)
            _find(value, path, found)
            path.pop()
    elif isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        for i, value in enumerate(tree):
            path.append(i)
            _find(value, path, found)
            path.pop()


def _strip(tree: Any, path: list[Any], found: list[tuple[list[Any], DTensor]]) -> Any:
    """A copy of ``tree`` with every DTensor replaced by None, its key path appended to ``found``."""
    if isinstance(tree, DTensor):
        found.append((list(path), tree))
        return None
    if isinstance(tree, Mapping):
        return type(tree)((k, _strip(v, [*path, k], found)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        items = [_strip(v, [*path, i], found) for i, v in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def mark(snap: Snapshot, dtensors: dict[str, DTensor]) -> ShardedSnapshot:
    """The snapshot with its sharded entries tagged ``"sharded"`` and the staged DTensors attached."""
    names = {key.rsplit("/", 1)[0] for key in dtensors}
    for entry in snap.entries:
        if entry[0] in names:
            entry[1] = SHARDED
    locals_ = [t.to_local() for t in dtensors.values()]
    nbytes = snap.nbytes + sum(t.numel() * t.element_size() for t in locals_)
    return ShardedSnapshot(snap.entries, snap.tensors, nbytes, snap.ends, packed=snap.packed, dtensors=dtensors)


class _GatedSavePlanner(DefaultSavePlanner):
    """DCP's own save planner, each of its steps one piece of torch work (:mod:`spotguard._forkgate`).

    ``dcp.save`` runs in the persist thread. Its planning and each item's resolution (the local
    shard taken, detached and given storage of its own) are torch operators; a loader forking its
    workers meanwhile must not cut through one. Gating the whole save would hold a fork for the
    save's length; gating the steps holds it for one step. The writes between them run ungated: by
    then each item is a plain CPU tensor that DCP only serializes (``_SerialCpuLoader`` finds
    nothing left to detach, move or copy)."""

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        with torch_work():
            super().set_up_planner(*args, **kwargs)

    def create_local_plan(self) -> Any:
        with torch_work():
            return super().create_local_plan()

    def create_global_plan(self, *args: Any, **kwargs: Any) -> Any:
        with torch_work():
            return super().create_global_plan(*args, **kwargs)

    def finish_plan(self, *args: Any, **kwargs: Any) -> Any:
        with torch_work():
            return super().finish_plan(*args, **kwargs)

    def resolve_data(self, write_item: Any) -> Any:
        with torch_work():
            data = super().resolve_data(write_item)
            if isinstance(data, torch.Tensor):
                data = data.detach().cpu()
                if data.untyped_storage().size() != data.nbytes:
                    data = data.clone()
            return data


def write_dcp(part: Path, snap: Snapshot, throttle: Throttle | None = None) -> dict[str, dict]:
    """Write the snapshot's DTensors into ``part/dcp`` (fsynced, mode 0600); returns
    ``{relpath: {size, sha256}}`` relative to ``part``, ``{}`` when the snapshot has none. Runs in
    the background save thread (reniced); DCP's writes are not CPU-capped, our hashing is. DCP's
    torch work runs in pieces no fork cuts through (:class:`_GatedSavePlanner`)."""
    dtensors = getattr(snap, "dtensors", None)
    if not dtensors:
        return {}
    out = part / DCP_DIR
    _fs.mkdir_private(out)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.save(dtensors, storage_writer=dcp.FileSystemWriter(out, sync_files=True), planner=_GatedSavePlanner(),
                     no_dist=True)
        except CheckpointException as exc:  # a BaseException: unwrap, so ENOSPC is still recognised
            raise _unwrap(exc) from exc
    names = sorted(os.listdir(out))
    chunks = _chunks(out, set(names))
    files = {}
    for name in names:
        os.chmod(out / name, 0o600)
        size, digest, ranges = _hash_file(out / name, throttle.run if throttle else None, chunks.get(name, ()))
        files[f"{DCP_DIR}/{name}"] = {"size": size, "sha256": digest, **({"ranges": ranges} if ranges else {})}
    _fs.fsync_dir(out)
    return files


def _chunks(out: Path, names: set[str]) -> dict[str, list[tuple[int, int]]]:
    """Where each saved chunk lies: ``{file: [(offset, length), ...]}`` from the metadata just
    written, so that each chunk gets a sha256 of its own (a resharding load that reads only some
    chunks of a file from the store checks each; see :mod:`.remote_shards`)."""
    metadata = SafeFileSystemReader(out, names).read_metadata()
    found: dict[str, set[tuple[int, int]]] = {}
    for info in metadata.storage_data.values():
        found.setdefault(info.relative_path, set()).add((int(info.offset), int(info.length)))
    return {name: sorted(spans) for name, spans in found.items()}


def _hash_file(path: Path, pace: Any = None,
               spans: Any = ()) -> tuple[int, str, list[list[Any]]]:
    """``(size, sha256, ranges)`` of a file read back in chunks (from the page cache, just
    written): ``ranges`` is ``[[offset, length, sha256], ...]`` of each span in ``spans``, hashed in
    the same pass."""
    digest, size = hashlib.sha256(), 0
    open_spans = [(offset, length, hashlib.sha256()) for offset, length in spans]
    update = (lambda h, b: pace(h.update, b)) if pace else (lambda h, b: h.update(b))  # noqa: E731
    with open(path, "rb") as f:
        while chunk := f.read(_fs.CHUNK_BYTES):
            update(digest, chunk)
            view = memoryview(chunk)
            for offset, length, hasher in open_spans:
                lo, hi = max(offset, size), min(offset + length, size + len(chunk))
                if lo < hi:
                    update(hasher, view[lo - size:hi - size])
            size += len(chunk)
    return size, digest.hexdigest(), [[o, n, h.hexdigest()] for o, n, h in open_spans]


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names DCP's ``.metadata`` needs; anything else is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if module in _DCP_MODULES and name in _DCP_CLASSES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise CheckpointCorruptError(f"DCP metadata references {module}.{name}, which is not allowed")


class SafeFileSystemReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` that unpickles ``.metadata`` restrictively, reads only the files in
    ``allowed`` (names checked against the manifest) and refuses non-tensor items."""

    def __init__(self, path: str | os.PathLike, allowed: set[str]) -> None:
        super().__init__(path)
        self.allowed = allowed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        raw = Path(self.path, ".metadata").read_bytes()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        except CheckpointCorruptError:
            raise
        except Exception as exc:
            raise CheckpointCorruptError(f"{self.path}: unreadable DCP metadata: {exc!r}") from exc
        if type(metadata).__name__ != "Metadata" or not isinstance(metadata.storage_data, dict):
            raise CheckpointCorruptError(f"{self.path}: DCP metadata is not a Metadata object")
        for info in metadata.storage_data.values():
            if getattr(info, "relative_path", None) not in self.allowed:
                raise CheckpointCorruptError(f"{self.path}: DCP metadata names an unverified file")
        metadata.storage_meta = StorageMeta(load_id=self.load_id)  # as DCP's reader sets it
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise CheckpointCorruptError(f"{self.path}: DCP metadata holds a non-tensor value (refused)")
        return super().read_data(plan, planner)


class _TensorOnlyPlanner(DefaultLoadPlanner):
    """Never reached behind SafeFileSystemReader; DCP's own load_bytes would unpickle freely."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointCorruptError("DCP checkpoint holds a non-tensor item; refused")


class _MergedReader(SafeFileSystemReader):
    """Reads the DCP shards of every part of a checkpoint as one: the parts' metadata, each read
    by a :class:`SafeFileSystemReader` of its own part (restricted unpickling, verified names), merged
    with every chunk's file named relative to the checkpoint directory. ``where(part)`` is the
    directory holding that part's ``dcp/.metadata`` (the checkpoint's, or a scratch directory for a
    part fetched from the store)."""

    def __init__(self, path: Path, parts: list[str], allowed: set[str],
                 where: Any = None) -> None:
        super().__init__(path, allowed)
        self.parts = parts
        self.where = where or (lambda part: path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        merged = None
        for part in self.parts:
            prefix = f"{part}/{DCP_DIR}/"
            own = {rel.removeprefix(prefix) for rel in self.allowed if rel.startswith(prefix)}
            if ".metadata" not in own:
                raise CheckpointCorruptError(f"{self.path}: the manifest lists no {prefix}.metadata")
            metadata = SafeFileSystemReader(Path(self.where(part), part, DCP_DIR), own).read_metadata()
            storage = {index: dataclasses.replace(info, relative_path=prefix + info.relative_path)
                       for index, info in metadata.storage_data.items()}
            if merged is None:
                merged, metadata.storage_data = metadata, storage
                continue
            for fqn, item in metadata.state_dict_metadata.items():
                known = merged.state_dict_metadata.setdefault(fqn, item)
                if known is not item and hasattr(known, "chunks"):
                    offsets = {tuple(c.offsets) for c in known.chunks}
                    known.chunks.extend(c for c in item.chunks if tuple(c.offsets) not in offsets)
            for index, info in storage.items():
                merged.storage_data.setdefault(index, info)  # a replicated chunk: any rank's copy
        return merged


class _RemoteMergedReader(_MergedReader):
    """A :class:`_MergedReader` whose parts not on this node are read from the store: only the
    chunks DCP's planner asks for (those overlapping this rank's new shards), each one ranged GET,
    checked against the chunk's sha256 recorded at save (``remote.read_range``), fetched in
    parallel in batches of at most :data:`REMOTE_BATCH_BYTES`."""

    def __init__(self, path: Path, parts: list[str], allowed: set[str], where: Any,
                 remote: Any, remote_parts: set[str]) -> None:
        super().__init__(path, parts, allowed, where)
        self.remote, self.remote_parts = remote, remote_parts

    def read_data(self, plan: Any, planner: Any) -> Any:
        from concurrent.futures import ThreadPoolExecutor

        from torch.futures import Future

        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise CheckpointCorruptError(f"{self.path}: DCP metadata holds a non-tensor value (refused)")
        infos = [self.storage_data[item.storage_index] for item in plan.items]
        if any(getattr(info, "transform_descriptors", None) for info in infos):
            raise CheckpointCorruptError(f"{self.path}: DCP chunks with transforms (refused)")

        def span(info: Any) -> bytes:
            rel, offset, length = info.relative_path, int(info.offset), int(info.length)
            if rel.split("/", 1)[0] in self.remote_parts:
                return self.remote.read_range(rel, offset, length)
            with open(Path(self.path, rel), "rb") as f:
                f.seek(offset)
                data = f.read(length)
            if len(data) != length:
                raise CheckpointCorruptError(f"{self.path}: {rel} is shorter than its DCP metadata says")
            return data

        batches: list[list[int]] = [[]]
        size = 0
        for i, info in enumerate(infos):
            if batches[-1] and size + int(info.length) > REMOTE_BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += int(info.length)
        with ThreadPoolExecutor(REMOTE_CONCURRENCY, thread_name_prefix="spotguard-shards") as pool:
            for batch in batches:
                for i, data in zip(batch, pool.map(lambda i: span(infos[i]), batch)):
                    item = plan.items[i]
                    tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        if length < tensor.size(dim):  # the part of the saved chunk this shard needs
                            tensor = tensor.narrow(dim, offset, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != tensor.size():
                        raise CheckpointCorruptError(f"{self.path}: a saved chunk has another shape than "
                                                     "its DCP metadata says")
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done


REMOTE_BATCH_BYTES = 256 << 20
"""At most this many bytes of chunks read from the store are held at once by a resharding load."""
REMOTE_CONCURRENCY = 8


def load_entries(path: Path, manifest: dict[str, Any], part: str,
                 entries: dict[str, tuple[str, Any]], state: Mapping[str, Any], *, verify: bool,
                 parts: int | None = None, remote: Any = None) -> None:
    """Replace each ``"sharded"`` entry's skeleton in ``entries`` by its full state_dict, read from
    ``path/part/dcp`` after checking every file there against the manifest's sha256 (``verify``).
    With ``parts`` (the saved world size, when it is not this job's), reshard from every part's
    ``dcp/`` instead; parts this checkpoint lacks (node-local roots: other nodes' ranks) are read
    from ``remote`` (see :mod:`spotguard.storage.shards`): their ``.metadata`` whole and only the
    chunks this rank's new shards overlap, each checked against its sha256."""
    names = [f"rank-{r}" for r in range(parts)] if parts else [part]
    absent = {n for n in names if f"{n}/{DCP_DIR}/.metadata" not in manifest["files"]} if parts else set()
    if absent and remote is None:
        raise CheckpointCorruptError(
            f"{path}: resharding from {parts} to another number of ranks needs every rank's shards, and "
            f"this node's checkpoint lacks {', '.join(sorted(absent))}'s, with no durable store to read "
            "them from: give the job its store (storage.url), or resume on the saved number of ranks")
    prefixes = tuple(f"{n}/{DCP_DIR}/" for n in names)
    files = {rel: meta for rel, meta in manifest["files"].items() if rel.startswith(prefixes)}
    if verify:
        for rel, meta in files.items():
            if _hash_file(path / rel)[1] != meta.get("sha256"):
                raise CheckpointCorruptError(f"{path}: sha256 mismatch in {rel}")
    if absent:
        _load_remote(path, names, absent, files, entries, state, remote)
        return
    if parts:
        def reader() -> SafeFileSystemReader:
            return _MergedReader(path, names, set(files))
    else:
        def reader() -> SafeFileSystemReader:
            return SafeFileSystemReader(path / part / DCP_DIR, {rel.removeprefix(prefixes[0]) for rel in files})
    _load_all(path, reader, entries, state)


def _load_all(path: Path, reader: Any, entries: dict[str, tuple[str, Any]], state: Mapping[str, Any]) -> None:
    """Load every ``"sharded"`` entry of ``entries`` that ``state`` holds through ``reader()``."""
    for name, (kind, value) in list(entries.items()):
        if kind == SHARDED and name in state:
            entries[name] = (kind, _load_entry(path, reader, state[name], value, name))


def _load_remote(path: Path, names: list[str], absent: set[str], files: dict[str, Any],
                 entries: dict[str, tuple[str, Any]], state: Mapping[str, Any], remote: Any) -> None:
    """The resharding load with some parts in the store: their ``.metadata`` fetched (verified)
    into a private scratch directory, their chunks read on demand."""
    import tempfile

    prefixes = tuple(f"{n}/{DCP_DIR}/" for n in sorted(absent))
    with tempfile.TemporaryDirectory(prefix="spotguard-shards-") as scratch:
        try:
            theirs = {rel: meta for rel, meta in remote.files().items() if rel.startswith(prefixes)}
            for n in sorted(absent):
                rel = f"{n}/{DCP_DIR}/.metadata"
                if rel not in theirs:
                    raise CheckpointCorruptError(f"{path}: the store's checkpoint lists no {rel}")
                target = Path(scratch, rel)
                _fs.mkdir_private(target.parent.parent)
                _fs.mkdir_private(target.parent)
                target.write_bytes(remote.read_whole(rel))
        except CheckpointCorruptError:
            raise
        except Exception as exc:  # the store's errors: this step cannot be resharded here
            raise CheckpointCorruptError(f"{path}: cannot read the other nodes' shards from the store: {exc}") from exc
        allowed = set(files) | set(theirs)
        where = lambda part: Path(scratch) if part in absent else path  # noqa: E731

        def reader() -> SafeFileSystemReader:
            return _RemoteMergedReader(path, names, allowed, where, remote, absent)

        _load_all(path, reader, entries, state)


def _load_entry(path: Path, reader: Any, target: Any, value: Any, name: str) -> Any:
    """``value`` (``{"tree", "dcp"}``) with its DTensors read into fresh DTensors shaped like the
    live ``target``'s, so a failed read leaves the live state untouched."""
    live = target.state_dict() if hasattr(target, "state_dict") else target
    fresh = {f"{name}/{i}": _empty_like(_lookup(live, p, name)) for i, p in enumerate(value["dcp"])}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(fresh, storage_reader=reader(), planner=_TensorOnlyPlanner(), no_dist=True)
    except (CheckpointException, Exception) as exc:  # DCP wraps failures in a BaseException
        cause = _unwrap(exc) if isinstance(exc, CheckpointException) else exc
        raise CheckpointCorruptError(f"{path}: cannot load sharded entry {name!r}: {cause}") from exc
    tree = value["tree"]
    for i, p in enumerate(value["dcp"]):
        tree = _put(tree, p, fresh[f"{name}/{i}"])
    return tree


def _unwrap(exc: CheckpointException) -> BaseException:
    """The first failure a CheckpointException carries (DCP wraps each rank's as (exc, traceback))."""
    for failure in exc.failures.values():
        return failure[0] if isinstance(failure, tuple) else failure
    return CheckpointError(str(exc))


def _lookup(tree: Any, path: list[Any], name: str) -> DTensor:
    node = tree
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            node = None
            break
    if not isinstance(node, DTensor):
        raise CheckpointCorruptError(f"entry {name!r}: the live state has no DTensor at {path} to load "
                                     "into (initialise optimizer state first: get_state_dict does)")
    return node


def _empty_like(t: DTensor) -> DTensor:
    local = torch.empty_like(t.to_local(), memory_format=torch.contiguous_format)
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def _put(tree: Any, path: list[Any], leaf: DTensor) -> Any:
    if not path:
        return leaf
    key, rest = path[0], path[1:]
    if isinstance(tree, tuple):
        return tuple(_put(v, rest, leaf) if i == key else v for i, v in enumerate(tree))
    tree[key] = _put(tree[key], rest, leaf)
    return tree
