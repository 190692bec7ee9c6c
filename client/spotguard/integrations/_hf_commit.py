"""Hugging Face checkpoints in spotguard's committed layout, so the daemon can make them durable.

The Trainer writes ``<output_dir>/checkpoint-<N>`` in place, without a manifest. The daemon uploads
only committed ``step-NNNNNNNNNN`` directories whose manifest lists every file (the rules of
:mod:`spotguard_daemon.core.confine`: regular files only, no symlinks, below the checkpoint root, steps
ordered per job), so :func:`commit_copy` copies a finished ``checkpoint-<N>`` into
``<output_dir>/spotguard/step-<N>`` through the same atomic commit a restore uses (private
``.tmp-`` directory, sha256 of every byte copied, ``manifest.json`` last, rename, ``latest``).
The daemon's checks then apply unchanged. The price is one local copy per save (the two newest
are kept).

The copy trusts nothing in the Trainer's directory: a symlink, FIFO or device anywhere in it (or a
file swapped for one while being copied: ``O_NOFOLLOW`` plus ``fstat``) refuses the whole copy with
:class:`NotCommitted`, and nothing is committed.

:func:`newest_committed` lists the committed copies that hold the Trainer's state file, so that
``latest_checkpoint`` can resume from one restored on a fresh node (the Trainer resumes from any
directory holding its files; ``manifest.json`` beside them is ignored).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from pathlib import Path

from spotguard.checkpoint.layout import committed_dirs, remove_checkpoint, remove_stale
from spotguard.storage._local import FORMAT, MANIFEST, ManifestError, commit_dir, read_manifest, step_name, tmp_dir

__all__ = ["COMMITTED", "NotCommitted", "commit_copy", "newest_committed"]

COMMITTED = "spotguard"
"""The directory under ``output_dir`` that holds the committed copies (and ``latest``)."""

_CHUNK = 4 << 20
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotCommitted(Exception):
    """The Trainer's checkpoint holds something other than directories and regular files."""


def _regular_files(src: Path) -> list[str]:
    """Relative paths of every file below ``src``; NotCommitted at the first non-regular entry."""
    found = []
    for where, dirs, names in os.walk(src, followlinks=False):
        for name in dirs + names:
            mode = os.lstat(os.path.join(where, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                rel = os.path.relpath(os.path.join(where, name), src)
                raise NotCommitted(f"{src}: {rel!r} is not a regular file or directory "
                                   f"({stat.filemode(mode)}); not committed")
        found += [os.path.relpath(os.path.join(where, n), src) for n in names]
    return sorted(found)


def _copy(source: Path, target: Path) -> dict[str, int | str]:
    """Copy one regular file (never through a symlink), hashing what was written."""
    fd = os.open(source, _OPEN)
    with os.fdopen(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotCommitted(f"{source} changed into a non-regular file while being copied")
        os.set_blocking(fd, True)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        digest, size = hashlib.sha256(), 0
        with open(target, "xb") as out:
            while block := src.read(_CHUNK):
                digest.update(block)
                out.write(block)
                size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def commit_copy(src: Path, root: Path, step: int, job_id: str, keep: int = 2) -> Path:
    """Commit a copy of the Trainer's checkpoint ``src`` as ``root/step-<step>``; keep the ``keep``
    newest copies. Raises NotCommitted (nothing committed) or OSError; ValueError without a
    ``job_id`` (the daemon would upload it under ``default``, shared by every job without one)."""
    if not job_id:
        raise ValueError("a committed copy needs a job id: the store keys checkpoints by it")
    files = _regular_files(src)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    remove_stale(root)  # copies cut off by a kill
    tmp = tmp_dir(root, step)
    try:
        table = {rel: _copy(src / rel, tmp / rel) for rel in files}
        manifest = {"format": FORMAT, "version": 1, "step": step, "job_id": job_id,
                    "source": "huggingface", "created": time.time(), "files": table}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        final = commit_dir(tmp, root, step_name(step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in committed_dirs(root)[max(keep, 1):]:
        remove_checkpoint(root, old)
    return final


def newest_committed(root: Path, state_file: str) -> tuple[int, Path] | None:
    """``(step, path)`` of the newest copy under ``root`` with a valid manifest naming ``state_file``."""
    for step, path in committed_dirs(root):
        try:
            manifest = read_manifest(path)
        except ManifestError:
            continue
        if manifest["step"] == step and state_file in manifest["files"]:
            return step, path
    return None
