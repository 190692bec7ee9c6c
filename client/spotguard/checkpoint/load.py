"""Verify and read a committed checkpoint, then restore it into a live state in place.

Verification before anything is restored: the manifest parses and names this format; every listed
file is a regular file (no symlink) inside the checkpoint, has an allowed name (``.bin``/``.json``,
or DCP's ``.metadata``/``__r_i.distcp`` in a part's ``dcp/``, whose pickle :mod:`.sharded` reads
restricted: nothing is unpickled freely) and the listed size; with ``verify`` the crc32 of each of
its chunks matches the manifest's, computed in a thread pool while the next chunk is read, or, for a
file listed without them (older checkpoints), its sha256, while the next file is read. Only then are
values decoded and handed to ``load_state_dict`` / ``copy_``, so a corrupt checkpoint never
half-overwrites a live state. The sha256 stays the content address of buckets (the daemon's uploads
and :mod:`spotguard.storage` check it); the local restore needs integrity only, at the disk's speed.

Large files are read into page-aligned buffers that the Checkpointer then adopts as its staging
buffers (:meth:`.Stager.adopt`): a restore costs one copy of the state, not two.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import zlib
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from spotguard.checkpoint import _fs
from spotguard.checkpoint._workers import Workers
from spotguard.checkpoint.commit import FORMAT, SMALL, TREE, VERSION
from spotguard.checkpoint.errors import CheckpointCorruptError, CheckpointError
from spotguard.checkpoint.format import decode, dtype_from_name
from spotguard.checkpoint.layout import MANIFEST, CommitInfo
from spotguard.checkpoint.staging import aligned_bytes

__all__ = ["read_manifest", "check", "read_entries", "restore"]

logger = logging.getLogger(__name__)
_SUFFIXES = (".bin", ".json")
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
        with Workers(2, "spotguard-ckpt-verify") as pool:
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
    def __init__(self, path: Path, files: dict, part: str, pool: Workers, verify: bool) -> None:
        self.path, self.files, self.part, self.pool, self.verify = path, files, part, pool, verify
        self.hashes: list[tuple[str, str, Any, Future[Any]]] = []
        """(relpath, what, expected, computed) of every check still to compare."""
        self.cache: dict[str, torch.Tensor] = {}

    def read_file(self, name: str) -> torch.Tensor:
        rel = f"{self.part}/{name}"
        if rel not in self.files:
            raise CheckpointCorruptError(f"{self.path}: {rel} is not listed in the manifest")
        if rel not in self.cache:
            meta = self.files[rel]
            buf = aligned_bytes(meta["size"])
            crcs = _chunk_crcs(meta) if self.verify else None
            chunk = meta["crc32_chunk"] if crcs is not None else _fs.CHUNK_BYTES

            def check_chunk(offset: int, piece: memoryview) -> None:
                expected = crcs[offset // chunk] if offset // chunk < len(crcs) else None
                computed = self.pool.submit(zlib.crc32, piece)
                self.hashes.append((rel, f"crc32 of bytes {offset}+", expected, computed))
            try:
                _fs.read_into(self.path / rel, memoryview(buf.numpy()), chunk,
                              check_chunk if crcs is not None else None)
            except (OSError, EOFError) as exc:
                raise CheckpointCorruptError(f"{self.path}: cannot read {rel}: {exc}") from exc
            if self.verify and crcs is None:
                self.hashes.append((rel, "sha256", meta.get("sha256"),
                                    self.pool.submit(_fs.sha256_of, memoryview(buf.numpy()))))
            elif crcs is not None and len(crcs) != -(-meta["size"] // chunk):
                raise CheckpointCorruptError(
                    f"{self.path}: {rel} lists {len(crcs)} crc32 chunks for {meta['size']} bytes")
            self.cache[rel] = buf
        return self.cache[rel]

    def tensors(self, index: list[dict[str, Any]]) -> list[torch.Tensor]:
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
        for rel, what, expected, digest in self.hashes:
            if digest.result() != expected:
                raise CheckpointCorruptError(f"{self.path}: {what} mismatch in {rel}")


def _chunk_crcs(meta: dict[str, Any]) -> list[int] | None:
    """The per-chunk crc32 of a manifest entry when it has a usable set (else None: use its sha256)."""
    crcs, chunk = meta.get("crc32"), meta.get("crc32_chunk")
    if not isinstance(crcs, list) or type(chunk) is not int or not 4096 <= chunk <= 1 << 30:
        return None
    return crcs


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
    if hasattr(target, "load_state_dict"):
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
