"""The local checkpoint layout shared with the checkpoint engine, and its atomic commit.

::

    <root>/latest                          text: name of the newest committed checkpoint + "\\n"
    <root>/step-0000000100/manifest.json   {"format": "spotguard-checkpoint", "version": 1, "step": 100,
                                            "files": {"<relpath>": {"size": n, "sha256": hex}}, ...}
    <root>/step-0000000100/<relpath>       data files

A directory becomes visible only by ``rename`` from ``<root>/.tmp-step-...-<pid>`` (the engine's
name for work in progress, so its stale-directory sweep also cleans a crashed restore) and ``latest`` only by
``rename`` from a temporary file, both followed by a directory ``fsync``: a crash leaves either the
old state or the new one. Errors: :class:`ManifestError` (a ``StoreError``) for an unusable manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from spotguard.storage.base import StoreError, check_key
from spotguard.storage.file import TMP_PREFIX, atomic_write, fsync_dir

__all__ = ["ManifestError", "commit_dir", "tmp_dir", "read_manifest", "sha256_file", "step_name", "validate_manifest"]

FORMAT = "spotguard-checkpoint"
MANIFEST = "manifest.json"


class ManifestError(StoreError):
    """A manifest is missing, unreadable, or describes files unsafely."""


def step_name(step: int) -> str:
    return f"step-{step:010d}"


def sha256_file(path: Path, chunk: int = 4 * 1024 * 1024) -> str:
    """Hex sha256 of a file, read in chunks (hashlib releases the GIL, so threads run in parallel)."""
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while block := src.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def validate_manifest(data: Any, where: str) -> dict[str, Any]:
    """Return ``data`` if it is a usable manifest: right format, integer step, safe relpaths."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or type(data.get("step")) is not int \
            or not 0 <= data["step"] < 10 ** 10:
        raise ManifestError(f"{where}: not a {FORMAT} manifest")
    files = data.get("files")
    if not isinstance(files, dict):
        raise ManifestError(f"{where}: manifest has no files table")
    for rel, meta in files.items():
        try:
            check_key(rel)
        except ValueError:
            raise ManifestError(f"{where}: unsafe file path {rel!r}") from None
        if rel == MANIFEST or not isinstance(meta, dict) or not _is_size(meta.get("size")) \
                or not _is_hex64(meta.get("sha256")):
            raise ManifestError(f"{where}: bad entry for {rel!r}")
    return data


MAX_FILE_BYTES = 1 << 44
"""16 TiB: no checkpoint file is larger; a manifest that says so is damaged or hostile."""


def _is_size(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_FILE_BYTES


def _is_hex64(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST
    try:
        return validate_manifest(json.loads(path.read_text()), str(path))
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: cannot read manifest ({exc})") from exc


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def tmp_dir(root: Path, step: int) -> Path:
    """A fresh, private work directory for ``step`` under ``root``, named like the engine's."""
    path = root / f"{TMP_PREFIX}{step_name(step)}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)
    return path


def commit_dir(tmp: Path, root: Path, name: str) -> Path:
    """Make the finished directory ``tmp`` visible as ``root/name`` and point ``root/latest`` at it.

    An existing ``root/name`` is replaced (moved aside first: a directory cannot be renamed over a
    non-empty one)."""
    _fsync_tree(tmp)
    final = root / name
    aside = root / f".trash-{name}-{os.getpid()}"  # the checkpoint engine's names for both
    shutil.rmtree(aside, ignore_errors=True)
    if final.exists():
        os.rename(final, aside)
    os.rename(tmp, final)
    atomic_write(root / "latest", lambda out: out.write((name + "\n").encode()))
    fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    return final
