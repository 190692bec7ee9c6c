"""Names and places under a checkpoint root (a contract with the durable-storage uploader).

::

    <root>/latest                       name of the newest committed checkpoint + "\\n" (a hint only)
    <root>/step-0000000100/             one committed checkpoint; manifest.json is its last file
    <root>/.tmp-step-0000000200-<pid>/  a save in progress; readers ignore it
    <root>/.trash-step-...-<pid>/       a checkpoint being deleted; readers ignore it

Readers trust only what a directory's manifest proves, so ``latest`` is a hint: a missing or stale
pointer falls back to scanning ``step-*`` directories, newest step first.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spotguard._root import alive
from spotguard.checkpoint import _fs

__all__ = [
    "CommitInfo",
    "VOLATILE",
    "combine_digests",
    "LATEST",
    "MANIFEST",
    "step_name",
    "tmp_name",
    "committed_dirs",
    "read_latest",
    "write_latest",
    "remove_checkpoint",
    "remove_own_trash",
    "remove_stale",
]

logger = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d{10})$")
_TMP_RE = re.compile(r"^\.(?:tmp|trash)-step-\d{10}-(\d+)$")


@dataclass(frozen=True)
class CommitInfo:
    """One committed checkpoint: what the guard layer reports to the daemon and the uploader."""

    step: int
    epoch: int | None
    path: Path
    size_bytes: int
    files: int
    created: float
    digest: str = ""
    """sha256 of the training state it holds, ``rng`` excluded ("" when unknown): equal digests
    mean bit-identical states (see :func:`spotguard.checkpoint.commit.part_digest`)."""


VOLATILE = frozenset({"rng"})
"""Entries left out of a state digest: an RNG a job never seeded starts from OS entropy in every
process, so two equally correct runs would differ there without differing in anything trained."""


def combine_digests(parts: list[str]) -> str:
    """The state digest of a checkpoint from its parts' digests, in rank order."""
    if len(parts) == 1:
        return parts[0]
    return hashlib.sha256("".join(f"{d}\n" for d in parts).encode()).hexdigest()


def step_name(step: int) -> str:
    if not 0 <= step < 10**10:
        raise ValueError(f"step must be in [0, 1e10), got {step}")
    return f"step-{step:010d}"


def tmp_name(step: int, pid: int, kind: str = "tmp") -> str:
    return f".{kind}-{step_name(step)}-{pid}"


def committed_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-*`` directory, newest first (valid or not)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), root / n) for n in names if (m := _STEP_RE.match(n))]
    return sorted((s, p) for s, p in found if p.is_dir() and not p.is_symlink())[::-1]


def read_latest(root: Path) -> str | None:
    """The name in ``latest`` when it is a well-formed step name, else None."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if _STEP_RE.match(name) else None


def write_latest(root: Path, name: str) -> None:
    """Atomically point ``latest`` at ``name``: write + fsync a temp file, rename, fsync root."""
    tmp = root / f"{LATEST}.tmp"
    tmp.unlink(missing_ok=True)
    _fs.write_file(tmp, f"{name}\n".encode())
    os.replace(tmp, root / LATEST)
    _fs.fsync_dir(root)


def remove_checkpoint(root: Path, path: Path, stop: Callable[[], bool] | None = None) -> bool:
    """Delete a committed checkpoint: first renamed out of readers' sight, then removed file by
    file until ``stop()`` says to leave the rest for later (:func:`remove_own_trash`). True when
    it is gone."""
    m = _STEP_RE.match(path.name)
    trash = root / tmp_name(int(m.group(1)) if m else 0, os.getpid(), "trash")
    _fs.remove_tree(trash)
    os.rename(path, trash)
    _fs.fsync_dir(root)
    return _remove_files(trash, stop)


def remove_own_trash(root: Path, stop: Callable[[], bool] | None = None) -> bool:
    """Finish the deletions this process left for later; True when none is left."""
    own = [n for n in os.listdir(root) if n.startswith(".trash-") and (m := _TMP_RE.match(n))
           and int(m.group(1)) == os.getpid()]
    return all(_remove_files(root / name, stop) for name in own)


def _remove_files(tree: Path, stop: Callable[[], bool] | None) -> bool:
    for dirpath, _, filenames in os.walk(tree, topdown=False):
        for name in filenames:
            if stop is not None and stop():
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(dirpath, name))
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
    return not tree.exists()


def remove_stale(root: Path) -> list[str]:
    """Remove ``.tmp-*``/``.trash-*`` directories whose process (on this host) is gone.

    Called before this process starts saving, so a directory carrying our own pid is stale too: a
    restarted container often reuses the pid of the process that died.
    """
    removed = []
    for name in os.listdir(root):
        m = _TMP_RE.match(name)
        if m and not _alive(int(m.group(1))):
            _fs.remove_tree(root / name)
            removed.append(name)
    if removed:
        logger.info("removed %d stale partial checkpoint(s) under %s", len(removed), root)
    return removed


def _alive(pid: int) -> bool:
    return pid != os.getpid() and alive(pid)
