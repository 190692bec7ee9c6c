"""Verification and restore of durable checkpoints (the reading half of :mod:`.durable`).

Restore downloads every file of a checkpoint in parallel into ``<dest_root>/.tmp-step-...-<pid>``,
re-hashes each one against the manifest, and only then commits the directory the way the checkpoint
engine does (rename, then ``latest``). A checkpoint whose manifest is corrupt or whose objects are
missing or do not hash right is skipped, with a warning, for the previous one; an explicitly
requested step is never substituted. Partial downloads are removed on every failure path.

Transient store errors (resets, truncated bodies, 5xx: :class:`TransientError`) are retried with
backoff until :data:`RETRY_SECONDS` (``Durable.retry_seconds``) have passed since the restore began,
one shared deadline for every request of the restore, like the upload path's retries. A checkpoint
is skipped for the previous one only when it is really damaged: a manifest that fails to parse, or an
object that fails its sha256, is read once more first, so a transfer cut short is never taken for
damage; and a skipped checkpoint is logged as an error.

A bucket is untrusted input: a ``latest`` naming a missing step falls back to the manifests; a
manifest whose key and step disagree, that is not plain JSON, or names unsafe paths is skipped; no
object larger than its manifest entry is downloaded, nor a checkpoint that cannot fit on disk;
restored files are bytes only (nothing is unpickled here). Progress is logged every
:data:`PROGRESS_EVERY_S` seconds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from spotguard.storage._keys import object_key
from spotguard.storage._local import (
    MANIFEST,
    ManifestError,
    commit_dir,
    sha256_file,
    step_name,
    tmp_dir,
)
from spotguard.storage.base import (
    CredentialsError,
    IntegrityError,
    NotFound,
    Store,
    StoreError,
    TransientError,
)
from spotguard.storage.file import make_private_dirs

__all__ = ["restore", "verify"]

log = logging.getLogger(__name__)


PROGRESS_EVERY_S = 10.0
"""At most one progress line per this many seconds while a restore downloads."""
RETRY_SECONDS = 60.0
"""How long one restore retries transient store errors before it gives up."""
RETRY_MAX_DELAY = 8.0


class Source(Protocol):
    """What a restore reads through: a :class:`~spotguard.storage.durable.Durable` (which calls
    this module; this module never imports it)."""

    store: Store
    concurrency: int
    retry_seconds: float

    def list(self, job_id: str) -> list[int]: ...

    def latest(self, job_id: str) -> int | None: ...

    def manifest(self, job_id: str, step: int, ranks: Sequence[int] | None = None) -> dict[str, Any]: ...


class Retry:
    """Runs store calls, retrying :class:`TransientError` with backoff (0.5 s doubling, at most
    ``RETRY_MAX_DELAY``) until ``until`` (monotonic); then the last error is raised, saying how long
    it was retried. Thread-safe: one deadline for every download of a restore."""

    def __init__(self, until: float) -> None:
        self.until = until
        self.started = time.monotonic()

    def __call__(self, call: Callable[[], Any], what: str) -> Any:
        attempt = 0
        while True:
            try:
                return call()
            except TransientError as exc:
                left = self.until - time.monotonic()
                if left <= 0:
                    raise TransientError(f"{exc} (still failing after {time.monotonic() - self.started:.0f} s "
                                         "of retries)") from exc
                delay = min(0.5 * 2 ** attempt, RETRY_MAX_DELAY, left)
                attempt += 1
                log.info("%s failed (%s); retrying in %.1f s", what, exc, delay)
                time.sleep(delay)


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


def _fetch(durable: Source, manifest: dict[str, Any], dest: Path, retry: Retry) -> list[str]:
    """Download and hash every file of ``manifest`` under ``dest``; return the problems found.
    Each object is downloaded once: files of the same content (the replicated state in every
    rank's part) are copied locally from the first one's verified download. Each download
    is refused when the object is larger than the manifest says; transient errors are retried
    (``retry``), and an object that fails its sha256 is downloaded once more before it counts as
    corrupt."""
    _check_room(manifest, dest)
    progress = _Progress(f"{durable.store.url} {step_name(manifest['step'])}",
                         sum(meta["size"] for meta in manifest["files"].values()))
    same: dict[tuple[str, int], list[str]] = {}
    for rel, meta in sorted(manifest["files"].items()):
        same.setdefault((meta["sha256"], meta["size"]), []).append(rel)

    def one(rels: list[str]) -> str | None:
        rel, meta = rels[0], manifest["files"][rels[0]]
        path, key = dest / rel, object_key(meta["sha256"])
        make_private_dirs(path.parent)
        for attempt in (1, 2):
            try:
                retry(lambda: durable.store.get_file(key, path, max_size=meta["size"]), f"download {key}")
            except NotFound:
                return f"{rel}: object {meta['sha256'][:12]}... is missing"
            except (TransientError, CredentialsError):
                raise  # not the checkpoint's fault: falling back to an older one would hide it
            except StoreError as exc:
                return f"{rel}: {exc}"
            if path.stat().st_size == meta["size"] and sha256_file(path) == meta["sha256"]:
                progress.add(meta["size"])
                for other in rels[1:]:
                    _same_content(path, dest / other)
                    progress.add(meta["size"])
                return None
            if attempt == 1:
                log.info("%s: %s does not hash to its address; downloading it once more", durable.store.url, key)
        return f"{rel}: object {meta['sha256'][:12]}... is corrupt (sha256 mismatch)"

    with ThreadPoolExecutor(durable.concurrency, thread_name_prefix="spotguard-restore") as pool:
        return [p for p in pool.map(one, same.values()) if p]


def _same_content(source: Path, path: Path) -> None:
    """A private copy of ``source``'s (verified) content at ``path``; not a hard link, which the
    daemon refuses to upload from a checkpoint (a link can reach outside its root). The tree is
    fsynced at its commit (:func:`commit_dir`)."""
    make_private_dirs(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with open(source, "rb") as src, os.fdopen(fd, "wb") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)


def verify(durable: Source, job_id: str, step: int, *, deep: bool) -> list[str]:
    try:
        manifest = durable.manifest(job_id, step)
    except ManifestError as exc:
        return [str(exc)]
    if not deep:
        return [f"{rel}: object {meta['sha256'][:12]}... is missing" for rel, meta in manifest["files"].items()
                if not durable.store.exists(object_key(meta["sha256"]))]
    with tempfile.TemporaryDirectory(prefix="spotguard-verify-") as scratch:
        return _fetch(durable, manifest, Path(scratch), Retry(time.monotonic() + durable.retry_seconds))


def _manifest(durable: Source, job_id: str, step: int, retry: Retry,
              ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """The manifest of ``step`` (with ``ranks``: the files of those ranks' parts and rank 0's at
    least), transient errors retried; one that fails to parse is read once more before it counts as
    damaged (a reply cut short is not damage)."""
    read = lambda: durable.manifest(job_id, step, ranks)  # noqa: E731
    try:
        return retry(read, f"read the manifest of {step_name(step)}")
    except ManifestError as exc:
        log.info("%s; reading it once more", exc)
    return retry(read, f"read the manifest of {step_name(step)}")


def select_ranks(manifest: dict[str, Any], ranks: Sequence[int] | None,
                 world_size: int | None = None) -> dict[str, Any]:
    """A global manifest cut down to what a node of node-local roots needs: its ``ranks``' parts
    and rank 0's (the replicated state, fetched once per node). A ``node`` section marks the result
    as restored (its daemon has nothing to upload) and names rank 0's part as the replicated one.
    When the job's ``world_size`` is not the saved one, sharded (DCP) files are left out: the
    resharding load reads only the chunks each rank needs, from the store
    (:mod:`spotguard.storage.shards`)."""
    if ranks is None:
        return manifest
    held = sorted({0, *ranks})
    prefixes = tuple(f"rank-{r}/" for r in held)
    resized = world_size is not None and world_size != manifest.get("world_size")
    files = {rel: meta for rel, meta in manifest["files"].items()
             if rel.startswith(prefixes) and not (resized and rel.split("/")[1:2] == ["dcp"])}
    return {**manifest, "files": files, "node": {"leader": 0, "ranks": held, "restored": True}}


def _restore_one(durable: Source, job_id: str, dest_root: Path, step: int, retry: Retry,
                 ranks: Sequence[int] | None = None, world_size: int | None = None) -> Path:
    manifest = select_ranks(_manifest(durable, job_id, step, retry, ranks), ranks, world_size)
    tmp = tmp_dir(dest_root, step)
    try:
        problems = _fetch(durable, manifest, tmp, retry)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise IntegrityError(f"{job_id} {step_name(step)}: {problems[0]}{more}")
        local = {k: v for k, v in manifest.items() if k != "durable"}
        (tmp / MANIFEST).write_text(json.dumps(local, indent=1))  # same content, key order kept
        return commit_dir(tmp, dest_root, step_name(step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _candidates(durable: Source, job_id: str) -> list[int]:
    """Steps to try: the one ``latest`` names (if it has a manifest), then every other manifest,
    newest first. A pointer naming a missing step never hides a sound checkpoint."""
    steps = durable.list(job_id)
    pointer = durable.latest(job_id)
    return ([pointer] if pointer in steps else []) + [s for s in reversed(steps) if s != pointer]


def restore(durable: Source, job_id: str, dest_root: Path, step: int | None,
            retry_until: float | None = None, ranks: Sequence[int] | None = None,
            world_size: int | None = None) -> Path:
    make_private_dirs(dest_root)
    retry = Retry(time.monotonic() + durable.retry_seconds if retry_until is None else retry_until)
    if step is not None:
        return _restore_one(durable, job_id, dest_root, step, retry, ranks, world_size)
    candidates = retry(lambda: _candidates(durable, job_id), f"list the checkpoints of {job_id}")
    if not candidates:
        raise NotFound(f"{durable.store.url}: job {job_id!r} has no durable checkpoint")
    for number in candidates:
        try:
            path = _restore_one(durable, job_id, dest_root, number, retry, ranks, world_size)
        except (IntegrityError, ManifestError, NotFound) as exc:
            log.error("durable %s: skipping %s, which is damaged, for the previous checkpoint: %s",
                      job_id, step_name(number), exc)
            continue
        log.info("durable %s: restored %s into %s", job_id, step_name(number), path)
        return path
    raise IntegrityError(f"{durable.store.url}: no sound checkpoint of job {job_id!r} "
                         f"(tried {len(candidates)})")
