"""Verification and restore of durable checkpoints (the reading half of :mod:`.durable`).

Restore downloads every file of a checkpoint in parallel into ``<dest_root>/.tmp-step-...-<pid>``,
re-hashes each one against the manifest, and only then commits the directory the way the checkpoint
engine does (rename, then ``latest``). A checkpoint whose manifest is corrupt or whose objects are
missing or do not hash right is skipped, with a warning, for the previous one; an explicitly
requested step is never substituted. Partial downloads are removed on every failure path.

A bucket is untrusted input: a ``latest`` naming a missing step falls back to the manifests; a
manifest whose key and step disagree, that is not plain JSON, or names unsafe paths is skipped; no
object larger than its manifest entry is downloaded, nor a checkpoint that cannot fit on disk;
restored files are bytes only (nothing is unpickled here). Progress is logged every
:data:`PROGRESS_EVERY_S` seconds.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.storage._local import MANIFEST, ManifestError, commit_dir, sha256_file, step_name, tmp_dir
from spotguard.storage.base import CredentialsError, IntegrityError, NotFound, StoreError, TransientError
from spotguard.storage.file import make_private_dirs

if TYPE_CHECKING:
    from spotguard.storage.durable import Durable

__all__ = ["restore", "verify"]

log = logging.getLogger(__name__)


PROGRESS_EVERY_S = 10.0
"""At most one progress line per this many seconds while a restore downloads."""


class _Progress:
    """Logs ``restore <what>: done/total bytes`` at most every PROGRESS_EVERY_S seconds."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.lock, self.last = threading.Lock(), time.monotonic()

    def add(self, size: int) -> None:
        with self.lock:
            self.done += size
            if time.monotonic() - self.last >= PROGRESS_EVERY_S:
                self.last = time.monotonic()
                log.info("restore %s: %d of %d MB (%.0f%%)", self.what, self.done >> 20, self.total >> 20,
                         100.0 * self.done / max(self.total, 1))


def _check_room(manifest: dict[str, Any], dest: Path) -> None:
    """Refuse, before downloading, a checkpoint that cannot fit (a hostile manifest's sizes must
    not fill the disk)."""
    need = sum(meta["size"] for meta in manifest["files"].values())
    free = shutil.disk_usage(dest).free
    if need > free:
        raise IntegrityError(f"checkpoint of {need} bytes does not fit in {dest} ({free} bytes free)")


def _fetch(durable: "Durable", manifest: dict[str, Any], dest: Path) -> list[str]:
    """Download and hash every file of ``manifest`` under ``dest``; return the problems found.
    Each download is refused when the object is larger than the manifest says."""
    from spotguard.storage.durable import object_key

    _check_room(manifest, dest)
    progress = _Progress(f"{durable.store.url} {step_name(manifest['step'])}",
                         sum(meta["size"] for meta in manifest["files"].values()))

    def one(item: tuple[str, dict[str, Any]]) -> str | None:
        rel, meta = item
        path = dest / rel
        make_private_dirs(path.parent)
        try:
            durable.store.get_file(object_key(meta["sha256"]), path, max_size=meta["size"])
        except NotFound:
            return f"{rel}: object {meta['sha256'][:12]}... is missing"
        except (TransientError, CredentialsError):
            raise  # not the checkpoint's fault: falling back to an older one would hide it
        except StoreError as exc:
            return f"{rel}: {exc}"
        progress.add(meta["size"])
        if path.stat().st_size != meta["size"] or sha256_file(path) != meta["sha256"]:
            return f"{rel}: object {meta['sha256'][:12]}... is corrupt (sha256 mismatch)"
        return None

    with ThreadPoolExecutor(durable.concurrency, thread_name_prefix="spotguard-restore") as pool:
        return [p for p in pool.map(one, sorted(manifest["files"].items())) if p]


def verify(durable: "Durable", job_id: str, step: int, *, deep: bool) -> list[str]:
    try:
        manifest = durable.manifest(job_id, step)
    except ManifestError as exc:
        return [str(exc)]
    if not deep:
        from spotguard.storage.durable import object_key

        return [f"{rel}: object {meta['sha256'][:12]}... is missing" for rel, meta in manifest["files"].items()
                if not durable.store.exists(object_key(meta["sha256"]))]
    with tempfile.TemporaryDirectory(prefix="spotguard-verify-") as scratch:
        return _fetch(durable, manifest, Path(scratch))


def _restore_one(durable: "Durable", job_id: str, dest_root: Path, step: int) -> Path:
    manifest = durable.manifest(job_id, step)
    tmp = tmp_dir(dest_root, step)
    try:
        problems = _fetch(durable, manifest, tmp)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise IntegrityError(f"{job_id} {step_name(step)}: {problems[0]}{more}")
        local = {k: v for k, v in manifest.items() if k != "durable"}
        (tmp / MANIFEST).write_text(json.dumps(local, indent=1))  # same content, key order kept
        return commit_dir(tmp, dest_root, step_name(step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _candidates(durable: "Durable", job_id: str) -> list[int]:
    """Steps to try: the one ``latest`` names (if it has a manifest), then every other manifest,
    newest first. A pointer naming a missing step never hides a sound checkpoint."""
    steps = durable.list(job_id)
    pointer = durable.latest(job_id)
    return ([pointer] if pointer in steps else []) + [s for s in reversed(steps) if s != pointer]


def restore(durable: "Durable", job_id: str, dest_root: Path, step: int | None) -> Path:
    make_private_dirs(dest_root)
    if step is not None:
        return _restore_one(durable, job_id, dest_root, step)
    candidates = _candidates(durable, job_id)
    if not candidates:
        raise NotFound(f"{durable.store.url}: job {job_id!r} has no durable checkpoint")
    for number in candidates:
        try:
            path = _restore_one(durable, job_id, dest_root, number)
        except (IntegrityError, ManifestError, NotFound) as exc:
            log.warning("durable %s: skipping %s, falling back to the previous checkpoint: %s",
                        job_id, step_name(number), exc)
            continue
        log.info("durable %s: restored %s into %s", job_id, step_name(number), path)
        return path
    raise IntegrityError(f"{durable.store.url}: no sound checkpoint of job {job_id!r} "
                         f"(tried {len(candidates)})")
