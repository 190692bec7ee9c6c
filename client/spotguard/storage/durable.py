"""Durable checkpoints in any :class:`~spotguard.storage.base.Store`: the commit protocol.

Layout under the store's prefix (object stores have no rename, so order is the commit)::

    objects/sha256/<hex>                         content-addressed file bodies, shared by all jobs
    jobs/<job>/pending/<unix>-<rand>.json        an upload in progress: {"hashes": [...]}
    jobs/<job>/manifests/step-0000000100.json    the local manifest + a "durable" section
    jobs/<job>/latest                            "step-0000000100\\n"
    jobs/<job>/parts/step-0000000100/node-<k>.<token>.json  a node's part (node-local roots, see :mod:`._parts`)
    jobs/<job>/refs/step-0000000100.<token>.json    the objects of a global step of parts (retention's index)
    jobs/<job>/parts/next.json                   the step node 0 proposes the others upload next (the daemon's)
    jobs/<job>/progress.json                     the daemon's goodput record of the job (not a checkpoint)

:meth:`Durable.upload` writes the pending note, then every object the store does not prove it holds
(``Store.holds``: the store's own checksum of the object matches the local file's; an object merely
present under the address is not trusted, see docs/storage.md on shared buckets), then the manifest,
then the pointer: ``latest`` never names a step whose objects were not verified. A reader that starts from the pointer or
a manifest therefore never sees a torn checkpoint: objects without a manifest are invisible, and the
pending note keeps :meth:`Durable.prune` from collecting them while the upload runs. Integrity is end
to end: the SDK checks each transfer (CRC32/CRC32C/MD5), new objects are hashed while they are
uploaded (read once; a file changed after commit raises IntegrityError and stores nothing), and :meth:`Durable.restore` re-hashes every file it downloads, falling back to the previous
checkpoint, with a warning, when one is corrupt or incomplete.

Errors are :mod:`.base`'s; a checkpoint that fails verification raises :class:`IntegrityError`.
Concurrency note: uploads and :meth:`~Durable.prune` of one prefix should be serialised (the
daemon's upload queue does this on one node). Across nodes (node-local roots) a prune may race an
upload that decided to reuse an object it found present; so the daemon prunes with a grace period
(an object is deleted only once unreferenced for :data:`GC_GRACE_SECONDS`, and the pending notes and
parts are read again right before the delete), and each node checks its part's objects present once
the part is in the store, sending again any deleted meanwhile.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from spotguard.storage import _parts, _references, _restore
from spotguard.storage._keys import OBJECTS, object_key
from spotguard.storage._local import ManifestError, read_manifest, step_name, validate_manifest
from spotguard.storage.base import IntegrityError, NotFound, Store, StoreError, TransientError

__all__ = ["Durable", "DurableInfo", "PruneReport", "JobDeleted", "UploadInFlight", "object_key", "progress_key"]

log = logging.getLogger(__name__)

_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MANIFEST = _references.MANIFEST

Progress = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` after each file is uploaded or skipped."""


MAX_MANIFEST_BYTES = 64 * 1024 * 1024
"""A manifest lists files, not data: anything larger is damage or an attack."""
GC_GRACE_SECONDS = 600.0
"""The daemon's ``prune(grace=)``: an object is deleted only after it was unreferenced this long."""
REPLICATED_WAIT_SECONDS = 60.0
"""How long a node other than node 0 waits for node 0's part before sending the replicated state."""
_INTERRUPT_EVERY = 0.05
MAX_POINTER_BYTES = 64
"""``latest`` holds ``step-NNNNNNNNNN\n``."""


def _step_of(text: str) -> int:
    """A step number as written in keys and pointers: 1-10 decimal digits (``step-%010d``)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 10):
        raise ValueError(f"not a step: {text[:20]!r}")
    return int(text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in JSON")


def _loads(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ManifestError(f"corrupt manifest: {exc}") from exc


def _job(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB.match(job_id) or ".." in job_id:
        raise ValueError(f"invalid job id {job_id!r}: letters, digits, '.', '_' and '-' only")
    return job_id


def manifest_key(job_id: str, step: int) -> str:
    return f"jobs/{_job(job_id)}/manifests/{step_name(step)}.json"


def progress_key(job_id: str) -> str:
    """Where the daemon keeps the job's last progress, so that a fresh node counts what a restart lost."""
    return f"jobs/{_job(job_id)}/progress.json"


@dataclass(frozen=True)
class DurableInfo:
    """What one :meth:`Durable.upload` did."""

    job_id: str
    step: int
    manifest_key: str
    files: int
    objects_uploaded: int
    objects_skipped: int
    bytes_uploaded: int
    bytes_total: int
    seconds: float
    pending_key: str = ""
    """The upload's pending note, still in the store when ``upload(cleanup=False)`` returned."""
    complete: bool = True
    """False for a node's part whose step is not global yet (another node's part is missing, or a
    lagging listing did not show it): :meth:`Durable.complete` checks again later."""


@dataclass(frozen=True)
class PruneReport:
    manifests_deleted: list[int]
    objects_deleted: int
    pending_deleted: int
    incomplete_cleaned: int


@dataclass(frozen=True)
class JobDeleted:
    """What one :meth:`Durable.delete_job` did."""

    steps: list[int]
    keys_deleted: int
    objects_deleted: int


class UploadInFlight(StoreError):
    """:meth:`Durable.delete_job` refused: the job has an upload in flight (a live pending note)."""


def _retrying(call: Callable[[], Any], attempts: int, what: str) -> Any:
    """Run ``call``, retrying :class:`TransientError` with exponential backoff (the SDKs retry each
    request already; this covers a whole multipart transfer failing)."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except TransientError as exc:
            if attempt == attempts:
                raise
            log.info("retrying %s after %s (attempt %d/%d)", what, exc, attempt, attempts)
            time.sleep(min(0.2 * 2 ** attempt, 5.0))


class Durable:
    """Checkpoints of many jobs in one store. Thread-safe for distinct jobs; see the module note."""

    def __init__(self, store: Store, *, concurrency: int = 8, attempts: int = 4,
                 retry_seconds: float = _restore.RETRY_SECONDS) -> None:
        self.store, self.concurrency, self.attempts = store, concurrency, attempts
        self.retry_seconds = retry_seconds
        """How long a restore retries transient errors (see :mod:`._restore`)."""
        self.replicated_wait = REPLICATED_WAIT_SECONDS
        """How long a node other than node 0 waits for node 0's part before it sends the
        replicated state itself (see :meth:`_send_after_node_0`)."""
        self._refs = _references.References(store, _loads)
        """What the prunes learnt of the store's immutable keys (parts, indexes)."""
        self._garbage_since: dict[str, float] = {}
        """Objects found unreferenced, and since when (``prune(grace=)``)."""

    # -- writing ---------------------------------------------------------------------------------

    def upload(self, local_ckpt_dir: Path, job_id: str, progress: Progress | None = None,
               interrupt: Callable[[int], None] | None = None, *, cleanup: bool = True) -> DurableInfo:
        """Make the committed local checkpoint ``local_ckpt_dir`` durable; return what was sent.

        ``interrupt(n)`` is called before each chunk of ``n`` bytes of each file is read
        (``Store.put_file``); an :class:`.base.Interrupted` it raises abandons the upload mid-file,
        unretried, as itself. With ``cleanup=False`` the pending note is left for the caller's
        :meth:`cleanup`, so that a slow delete does not delay what it does once the step is durable.

        Raises :class:`ManifestError` for a bad local manifest, :class:`IntegrityError` when a
        local file does not match its manifest, and the store's errors (retry later on
        :class:`TransientError`: objects already sent are reused)."""
        started, ckpt = time.monotonic(), Path(local_ckpt_dir)
        manifest = read_manifest(ckpt)
        by_hash = {meta["sha256"]: (rel, meta["size"]) for rel, meta in manifest["files"].items()}
        key = manifest_key(job_id, manifest["step"])
        if "node" in manifest and manifest["node"].get("restored") is True:
            if not self.store.exists(key):  # fetched from the store: nothing to send, no note
                raise ManifestError(f"{ckpt}: restored from the store, whose {key} is gone")
            return DurableInfo(job_id, manifest["step"], key, len(manifest["files"]), 0, len(by_hash), 0,
                               sum(size for _, size in by_hash.values()), time.monotonic() - started)
        pending = f"jobs/{_job(job_id)}/pending/{int(time.time())}-{uuid.uuid4().hex[:8]}.json"
        self.store.put_bytes(pending, json.dumps({"hashes": sorted(by_hash)}).encode())
        if "node" in manifest and manifest["node"].get("index", 0) != 0:
            sent = self._send_after_node_0(ckpt, manifest, job_id, by_hash, progress, interrupt)
        else:
            sent = self._send_objects(ckpt, by_hash, progress, interrupt)
        durable = {"version": 1, "name": ckpt.name, "objects": OBJECTS, "uploaded": time.time()}
        uploaded = {**manifest, "durable": durable}
        if "node" in manifest:  # one node's part: the global manifest waits for every node's
            _parts.node_of(manifest, str(ckpt))
            uploaded = _parts.uploaded_part(manifest, durable)
            key = _parts.part_key(job_id, manifest["step"], manifest["node"]["index"], _parts.token(uploaded))
        body = json.dumps(uploaded, indent=1).encode()
        _retrying(lambda: self.store.put_bytes(key, body), self.attempts, key)
        if "node" in manifest:  # named by a part now: another node's prune spares them from here on
            sent += self._send_missing(ckpt, by_hash, interrupt)
        complete = "node" not in manifest or self._complete(job_id, manifest["step"], json.loads(body))
        if complete:
            self._advance_pointer(job_id, manifest["step"])
        total = sum(size for _, size in by_hash.values())
        info = DurableInfo(job_id, manifest["step"], key, len(manifest["files"]), len(sent),
                           len(by_hash) - len(sent), sum(sent), total, time.monotonic() - started, pending,
                           complete)
        log.info("durable %s step %d: %d/%d objects sent, %d bytes in %.2fs", job_id, info.step,
                 info.objects_uploaded, len(by_hash), info.bytes_uploaded, info.seconds)
        if cleanup:
            self.cleanup(info)
        return info

    def complete(self, job_id: str, step: int) -> bool:
        """Check again whether every node's part of ``step`` is in the store; if so, write the
        global manifest and advance the pointer. True once ``step`` is
        global. The daemon calls this for a part whose step was not complete at its upload: the
        other nodes' parts came later, or the store's listing lagged."""
        if self.store.exists(manifest_key(job_id, step)) or self._complete(job_id, step):
            self._advance_pointer(job_id, step)
            return True
        return False

    def _complete(self, job_id: str, step: int, own: dict[str, Any] | None = None) -> bool:
        """Write the global manifest of ``step`` if every node's part of ``own``'s incarnation (the
        part this node uploaded; default: any incarnation's, the newest if several) is in the store
        (see :mod:`._parts`: one LIST, and one GET of node 0's part unless this node is node 0);
        True once it is. Each node checked its own objects present after its part was in the store
        (:meth:`_send_missing`), so the set is not read again here."""
        job = _job(job_id)
        found = _retrying(lambda: _parts.listed(self.store, job, step), self.attempts, f"parts of step {step}")
        tokens = [_parts.token(own)] if own is not None else sorted(found)
        candidates = []
        for token in tokens:
            have = found.get(token, {})
            if 0 not in have or (own is not None and not set(range(own["node"]["nodes"])) <= set(have)):
                continue  # one LIST and no GET while some node's part is missing (all but the last node)
            first = own if own is not None and own["node"]["index"] == 0 else _retrying(
                lambda: _parts.read_part(self.store, have[0], 0, step, token, MAX_MANIFEST_BYTES, _loads),
                self.attempts, have[0])
            if set(range(first["node"]["nodes"])) <= set(have):
                candidates.append(first)
        if not candidates:
            log.info("durable %s step %d: this node's part is in the store; waiting for the other nodes'",
                     job_id, step)
            return False
        first = max(candidates, key=lambda part: part["durable"].get("uploaded", 0)
                    if isinstance(part.get("durable"), dict) else 0)
        manifest = _parts.global_manifest(first, own if own is not None else first, step)
        key, body = manifest_key(job_id, step), _parts.dumps(manifest)
        if self._write_once(key, body, manifest["parts"]["token"]):
            log.info("durable %s step %d: every node's part is in the store; global manifest written", job_id, step)
        return True

    def _write_once(self, key: str, body: bytes, token: str) -> bool:
        """Write the global manifest ``key`` unless another node wrote it first (one write a step
        where the store can tell, ``put_bytes_if_absent``); a global manifest of another incarnation
        under the key (a relaunch's step N replacing the abandoned run's) is replaced. True when
        this call wrote it."""
        put_new = getattr(self.store, "put_bytes_if_absent", None)
        if put_new is None:
            _retrying(lambda: self.store.put_bytes(key, body), self.attempts, key)
            return True
        if _retrying(lambda: put_new(key, body), self.attempts, key):
            return True
        try:
            there = _loads(_retrying(lambda: self.store.get_bytes(key, max_size=MAX_MANIFEST_BYTES), self.attempts, key))
        except (ManifestError, NotFound, IntegrityError):
            there = None
        parts = there.get("parts") if isinstance(there, dict) else None
        if isinstance(parts, dict) and parts.get("token") == token:
            log.info("durable: %s was written by another node first (the same bytes)", key)
            return False
        log.warning("durable: %s held another save's global manifest (an abandoned run's); replacing it", key)
        _retrying(lambda: self.store.put_bytes(key, body), self.attempts, key)
        return True

    def _send_missing(self, ckpt: Path, by_hash: dict[str, tuple[str, int]],
                      interrupt: Callable[[int], None] | None) -> list[int]:
        """Send again the objects of this node's part that the store lacks, checked after the part
        is in the store: another node's retention may have deleted one this upload found present
        (the race :meth:`prune`'s grace narrows), and a step is made global only from parts whose
        objects were there after the part was."""
        def gone(sha: str) -> bool:
            key = object_key(sha)
            return not _retrying(lambda: self.store.exists(key), self.attempts, key)

        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="spotguard-check") as pool:
            missing = [sha for sha, lost in zip(by_hash, pool.map(gone, by_hash)) if lost]
        if missing:
            log.warning("durable: %d object(s) of %s were gone from the store once its part was written "
                        "(e.g. %s; deleted by another node's retention?); sending them again",
                        len(missing), ckpt, object_key(missing[0]))
        return [self._send_one(ckpt / by_hash[sha][0], sha, by_hash[sha][1], interrupt) for sha in missing]

    def _send_after_node_0(self, ckpt: Path, manifest: dict[str, Any], job_id: str,
                           by_hash: dict[str, tuple[str, int]], progress: Progress | None,
                           interrupt: Callable[[int], None] | None) -> list[int]:
        """A node other than node 0 sends its own ranks' files first, then waits (at most
        :attr:`replicated_wait` seconds) for node 0's part of the same save before its leader's
        files, which hold the replicated state: node 0 has sent those bytes by then, the store
        proves it (``Store.holds``), and they are not sent again. The replicated state crosses the
        network once a step, not once a node; the wait never delays the global step, which needs
        node 0's part anyway."""
        leader = f"rank-{manifest['node']['leader']}/"
        later = {sha: v for sha, v in by_hash.items() if v[0].startswith(leader)}
        first = {sha: v for sha, v in by_hash.items() if sha not in later}
        total, done_first = sum(size for _, size in by_hash.values()), sum(size for _, size in first.values())
        say = (lambda base: lambda done, _: progress(base + done, total)) if progress else (lambda base: None)
        sent = self._send_objects(ckpt, first, say(0), interrupt)
        self._await_node_0(_parts.part_key(job_id, manifest["step"], 0, _parts.token(manifest)), interrupt)
        return sent + self._send_objects(ckpt, later, say(done_first), interrupt)

    def _await_node_0(self, key: str, interrupt: Callable[[int], None] | None) -> bool:
        """Look for node 0's part once a second; ``interrupt`` is asked every :data:`_INTERRUPT_EVERY`
        seconds in between (a newer commit abandons the wait at once, not a second later)."""
        deadline = time.monotonic() + self.replicated_wait
        while True:
            try:
                if self.store.exists(key):
                    return True
            except TransientError:
                pass
            if time.monotonic() >= deadline:
                log.info("durable: node 0's part %s is not in the store after %.0f s; sending the "
                         "replicated state from this node too", key, self.replicated_wait)
                return False
            look = min(time.monotonic() + 1.0, deadline)
            while (left := look - time.monotonic()) > 0:
                if interrupt is not None:
                    interrupt(0)
                time.sleep(min(_INTERRUPT_EVERY, left))

    def cleanup(self, info: DurableInfo) -> None:
        """Remove the pending note of an upload that is durable; a failure is logged (prune removes
        the note once it is stale)."""
        try:
            self.store.delete([info.pending_key])
        except StoreError as exc:
            log.info("durable %s: could not remove %s: %s", info.job_id, info.pending_key, exc)

    def _send_objects(self, ckpt: Path, by_hash: dict[str, tuple[str, int]],
                      progress: Progress | None,
                      interrupt: Callable[[int], None] | None) -> list[int]:
        total, done, sent, lock = sum(s for _, s in by_hash.values()), [0], [], threading.Lock()

        def one(sha: str) -> None:
            rel, size = by_hash[sha]
            if not self._proven(ckpt / rel, sha, size):
                sent.append(self._send_one(ckpt / rel, sha, size, interrupt))
            with lock:
                done[0] += size
                if progress:
                    progress(done[0], total)

        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="spotguard-upload") as pool:
            list(pool.map(one, sorted(by_hash, key=lambda h: -by_hash[h][1])))
        return sent

    def _proven(self, path: Path, sha: str, size: int) -> bool:
        """Whether the store proves it holds ``path``'s bytes under their address (``Store.holds``):
        only then is the object reused. A store without ``holds`` proves nothing."""
        holds = getattr(self.store, "holds", None)
        if holds is None:
            return False
        key = object_key(sha)
        return _retrying(lambda: holds(key, path, sha, size), self.attempts, key)

    def _send_one(self, path: Path, sha: str, size: int,
                  interrupt: Callable[[int], None] | None = None) -> int:
        """The store hashes the bytes as it sends them and refuses a mismatch (IntegrityError), so a
        file changed after commit is never stored under the manifest's address."""
        send = lambda: self.store.put_file(object_key(sha), path, sha256=sha, size=size,  # noqa: E731
                                           interrupt=interrupt)
        return _retrying(send, self.attempts, object_key(sha))

    def _advance_pointer(self, job_id: str, step: int) -> None:
        """Point ``latest`` at ``step`` unless it already names a newer step (uploads may finish
        out of order)."""
        current = self.latest(job_id)
        if current is None or current <= step:
            key = f"jobs/{_job(job_id)}/latest"
            body = (step_name(step) + "\n").encode()
            _retrying(lambda: self.store.put_bytes(key, body), self.attempts, key)

    # -- reading ---------------------------------------------------------------------------------

    def jobs(self) -> list[str]:
        """The jobs with at least one manifest in the store, sorted."""
        return sorted({found.group(1) for key in self.store.list("jobs/")
                       if (found := _MANIFEST.match(key))})

    def keys_of(self, job_id: str) -> list[str]:
        """Every key under ``jobs/<job>/``: manifests, pointer, node parts, notes, progress."""
        return list(self.store.list(f"jobs/{_job(job_id)}/"))

    def list(self, job_id: str) -> list[int]:
        """Steps with a manifest, oldest first."""
        steps = []
        for key in self.store.list(f"jobs/{_job(job_id)}/manifests/"):
            if found := _MANIFEST.match(key):
                steps.append(int(found.group(2)))
        return sorted(steps)

    def latest(self, job_id: str) -> int | None:
        """The step ``latest`` names if that step has a manifest; else (pointer missing, unreadable,
        or naming a step that does not exist: a damaged or hostile bucket) the newest manifest."""
        try:
            text = self.store.get_bytes(f"jobs/{_job(job_id)}/latest", max_size=MAX_POINTER_BYTES).decode().strip()
            step = _step_of(text.removeprefix("step-"))
            if self.store.exists(manifest_key(job_id, step)):
                return step
            log.warning("durable %s: latest names %s, which has no manifest; using the newest manifest",
                        job_id, step_name(step))
        except NotFound:
            pass
        except (ValueError, UnicodeDecodeError, IntegrityError):
            log.warning("durable %s: unreadable latest pointer, using the newest manifest", job_id)
        steps = self.list(job_id)
        return steps[-1] if steps else None

    def manifest(self, job_id: str, step: int, ranks: Sequence[int] | None = None) -> dict[str, Any]:
        """The durable manifest of ``step``, with every file: a global manifest of node parts has
        them read from its parts (all of them, or with ``ranks`` only those holding these ranks and
        rank 0; in parallel). :class:`NotFound`, or :class:`ManifestError` if corrupt, oversized,
        not plain JSON (NaN, deep nesting), naming another step than its key, or a part that does
        not match it."""
        key, where = manifest_key(job_id, step), f"{self.store.url}/{manifest_key(job_id, step)}"
        data = self._read_manifest(key, where)
        if data["step"] != step:
            raise ManifestError(f"{where}: says step {data['step']}, its key says {step}")
        if "parts" not in data:
            return data
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="spotguard-parts") as pool:
            return _parts.resolve(self.store, _job(job_id), data, where, MAX_MANIFEST_BYTES, _loads, ranks, pool.map)

    def _read_manifest(self, key: str, where: str) -> dict[str, Any]:
        try:
            body = self.store.get_bytes(key, max_size=MAX_MANIFEST_BYTES)
        except IntegrityError as exc:  # over MAX_MANIFEST_BYTES, or no regular file
            raise ManifestError(f"implausible manifest: {exc}") from exc
        try:
            return validate_manifest(json.loads(body, parse_constant=_refuse_constant), where)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ManifestError(f"{where}: corrupt manifest") from exc

    def verify(self, job_id: str, step: int, *, deep: bool = True) -> list[str]:
        """Problems with durable ``step`` (empty when sound). ``deep`` downloads and re-hashes every
        object; otherwise only their presence is checked."""
        return _restore.verify(self, job_id, step, deep=deep)

    def restore(self, job_id: str, dest_root: Path, step: int | None = None, *,
                retry_until: float | None = None, ranks: Sequence[int] | None = None,
                world_size: int | None = None) -> Path:
        """Download ``step`` (default: the newest sound checkpoint) into ``dest_root/step-...``, commit
        it like a local checkpoint (``latest`` updated) and return its path. Transient errors are
        retried until ``retry_until`` (monotonic; default ``retry_seconds`` from now). Raises
        :class:`NotFound` when the job has no checkpoint, :class:`IntegrityError` when none is sound,
        :class:`TransientError` when the store kept failing. ``ranks`` (a node of node-local roots)
        fetches only those ranks' parts and rank 0's, without their sharded files when the job's
        ``world_size`` differs from the saved one (see :func:`._restore.select_ranks`)."""
        return _restore.restore(self, _job(job_id), Path(dest_root), step, retry_until, ranks, world_size)

    # -- retention -------------------------------------------------------------------------------

    def prune(self, job_id: str, keep: int, *, pending_ttl: float = 24 * 3600,
              grace: float = 0.0) -> PruneReport:
        """Keep the newest ``keep`` manifests of ``job_id`` (and whatever ``latest`` names), then
        delete every object that no manifest or node part of any job under this prefix, and no
        pending upload younger than ``pending_ttl`` seconds, references. Stale pending notes and
        crashed partial uploads (``clean_incomplete``) are removed too.

        ``grace`` (seconds; the daemon's is :data:`GC_GRACE_SECONDS`) deletes an object only once
        this :class:`Durable` found it unreferenced ``grace`` seconds ago and again now, and the
        pending notes are read once more right before the delete: an upload on another node that
        decided to reuse the object meanwhile has named it by then. The notes and node parts are read
        again right before any delete, grace or not (parts already read are not read again)."""
        if keep < 1:
            raise ValueError("keep must be >= 1")
        steps, pointer = self.list(job_id), self.latest(job_id)
        doomed = [s for s in steps[:-keep] if s != pointer]
        self.store.delete(manifest_key(job_id, s) for s in doomed)
        oldest = min((s for s in steps if s not in doomed), default=0)  # older node parts are done with
        done_with = lambda k: ((m := _parts.PART.match(k) or _references.REFS.match(k))  # noqa: E731
                               and int(m.group(2)) < oldest)
        self.store.delete(k for where in ("parts", "refs") for k in self.store.list(f"jobs/{_job(job_id)}/{where}/")
                          if done_with(k))
        objects, pending = self._collect_garbage(pending_ttl, grace)
        clean = getattr(self.store, "clean_incomplete", None)
        return PruneReport(doomed, objects, pending, clean(pending_ttl) if clean else 0)

    def delete_job(self, job_id: str, *, pending_ttl: float = 24 * 3600) -> JobDeleted:
        """Delete every checkpoint of ``job_id`` and what the job keeps under ``jobs/<job>/``, then
        the objects no other job's manifest, part or live upload references (shared objects stay).

        Refused (:class:`UploadInFlight`, nothing deleted) while the job has a pending note younger
        than ``pending_ttl``: an upload of it is in flight and would commit a step whose objects
        this deleted. ``latest`` goes first, so no reader follows it to a manifest that is gone;
        the objects go last, and only those unreferenced once every key of the job is deleted."""
        prefix = f"jobs/{_job(job_id)}/"
        keys = self.keys_of(job_id)
        live = [k for k in keys if k.startswith(f"{prefix}pending/") and not _references.pending_is_stale(k, pending_ttl)]
        if live:
            raise UploadInFlight(f"nothing deleted: {self.store.url}: job {job_id!r} has an upload in flight "
                                 f"({live[0]}); stop the job's daemon or wait for the upload to end")
        steps = sorted(int(found.group(2)) for key in keys if (found := _MANIFEST.match(key)))
        pointer = f"{prefix}latest"
        if pointer in keys:
            self.store.delete([pointer])
        self.store.delete(sorted((k for k in keys if k != pointer), reverse=True))  # manifests: newest first
        objects, _ = self._collect_garbage(pending_ttl, 0.0) if keys else (0, 0)
        log.info("durable %s: deleted job %s (%d checkpoints, %d keys, %d objects)", self.store.url, job_id,
                 len(steps), len(keys), objects)
        return JobDeleted(steps, len(keys), objects)

    def _collect_garbage(self, pending_ttl: float, grace: float) -> tuple[int, int]:
        present = set(self.store.list(OBJECTS))  # listed first: later uploads are never collected
        referenced, stale = self._refs.collect(pending_ttl)
        if referenced is None:
            return 0, 0
        garbage = [key for key in present if key[len(OBJECTS):] not in referenced]
        if grace > 0:
            garbage = self._past_grace(garbage, grace)
        if garbage:  # an upload that started since: its note (then its part) names what it reuses
            named = self._refs.collect(pending_ttl, live_only=True)[0]
            garbage = [key for key in garbage if named is not None and key[len(OBJECTS):] not in named]
        self.store.delete(garbage + stale)
        if garbage:
            log.info("durable %s: deleted %d unreferenced objects", self.store.url, len(garbage))
        return len(garbage), len(stale)

    def _past_grace(self, garbage: list[str], grace: float) -> list[str]:
        """The objects of ``garbage`` that were garbage ``grace`` seconds ago already."""
        now, seen = time.time(), self._garbage_since
        for key in set(seen) - set(garbage):
            del seen[key]  # referenced again
        return [key for key in garbage if now - seen.setdefault(key, now) >= grace]
