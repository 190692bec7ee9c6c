"""The start of a :class:`spotguard.run.Run`: fetch a newer checkpoint from the durable store (a
fresh node), then load the newest local one, refusing one that does not fit the state; or, asked
for a fresh start (``Run(fresh=True)``, ``$SPOTGUARD_FRESH=1``), remove the local checkpoints and
start at step 0."""

from __future__ import annotations

import logging
import os
from typing import Any

from spotguard import _jobid
from spotguard._run_common import fetch_common_step, mark_fetched
from spotguard._root import StartRefused
from spotguard._run_parts import distributed, local_rank
from spotguard.checkpoint import CheckpointCorruptError, CheckpointError, layout
from spotguard.checkpoint.load import read_manifest
from spotguard.storage import Durable, StoreError, open_store, restore_newer, store_from_env
from spotguard.storage.fresh_node import DEFAULT_JOB, RestoreFailed
from spotguard.storage.peer import peers_from_env
from spotguard.storage.shards import from_store

__all__ = ["load_latest", "restore_from_store", "start_fresh", "fresh_requested", "plan", "FRESH_ENV"]

FRESH_ENV = "SPOTGUARD_FRESH"
"""``1``: start over (see :func:`start_fresh`); ``spotguard run`` passes it to its first launch only."""

log = logging.getLogger("spotguard.run")


def load_latest(run: Any) -> Any:
    """Load the newest checkpoint; one that does not fit the state (another model, another run
    in this root) is refused with a message naming the fix, never half-loaded silently."""
    try:
        info = run.checkpointer.load_latest(run.state)
    except CheckpointCorruptError:
        raise
    except CheckpointError as exc:
        latest = run.checkpointer.latest()
        if latest is None:
            raise
        raise CheckpointError(_jobid.mismatch_message(
            latest.path, read_manifest(latest.path), run._job_id, " ".join(str(exc).split()).rstrip("."))) from exc
    if info is not None:
        manifest = read_manifest(info.path)
        _jobid.check_matches(manifest, run.state, run._job_id, info.path)
        if manifest.get("job_id") not in ("", None, run._job_id):
            log.warning("resuming %s, written by job %r; this is job %r (same checkpoint root)",
                        info.path, manifest.get("job_id"), run._job_id)
    return info


def restore_from_store(run: Any) -> None:
    """The fresh-node case: when the durable store holds a newer checkpoint than the local root,
    fetch it first, so the load below finds it. The store is ``durable=``, else
    ``$SPOTGUARD_STORAGE__URL``, else the daemon's; one process per node fetches while the others
    wait. A store that keeps failing (transient errors are retried for a minute) is logged and
    training goes on from what is local; when the store held, or may have held, a newer
    checkpoint, that is an error and a ``restore_failed`` record event (work is lost)."""
    url, options = store_from_env()
    url = run._durable or url or daemon_store(run)
    # With the peer tier on node-local roots, the agreement below picks the step and fetches it from
    # a partner first: fetching the store's newest here would pull from the bucket what a partner holds.
    peer_first = getattr(run.checkpointer, "node_ranks", None) is not None and bool(peers_from_env()[0])
    if url and local_rank() == 0 and not peer_first:
        try:
            restored = restore_newer(run.checkpointer.root, run._job_id, url, options,
                                     ranks=getattr(run.checkpointer, "node_ranks", None),
                                     world_size=getattr(run.checkpointer, "world_size", None))
            if restored is not None:
                run._restored_from = f"restored from the store {url.split('?', 1)[0]}:"
                run._tier = "bucket"
                mark_fetched(restored, "bucket")
        except RestoreFailed as exc:
            log.error("%s; going on with local checkpoints (steps after them are trained again)", exc)
            run.record.emit("restore_failed", store=url.split("?", 1)[0], store_step=exc.store_step,
                             local_step=exc.local_step, error=str(exc))
        except (StoreError, OSError) as exc:
            log.warning("could not restore from %s (%s); going on with local checkpoints", url, exc)
    if run.agreement.enabled:
        distributed().barrier(group=run.agreement.process_group)
    try:  # node-local roots: the newest step every rank holds or can fetch (collective)
        fetch_common_step(run, url, options)
    except StoreError as exc:
        log.warning("could not agree on a step with the store (%s); going on with local checkpoints", exc)
    if url and getattr(run.checkpointer, "node_ranks", None) is not None:
        run.checkpointer.remote_shards = from_store(url, run._job_id or DEFAULT_JOB, options)


def daemon_store(run: Any) -> str | None:
    uploads = (run.guard.daemon_status() or {}).get("uploads") or {}
    store = uploads.get("store")
    return store if isinstance(store, str) and "://" in store else None


def fresh_requested(fresh: bool | None) -> bool:
    """``fresh``, else ``$SPOTGUARD_FRESH`` (``1``, ``true``, ``yes``)."""
    if fresh is not None:
        return fresh
    return os.environ.get(FRESH_ENV, "").strip().lower() in ("1", "true", "yes")


def start_fresh(run: Any) -> None:
    """Start over: nothing is restored from the store, and the root's leader removes its
    committed checkpoints (every rank waits for it). A durable store that holds checkpoints of
    this job refuses the start: a fresh node would restore them over the new run, and the daemon
    accepts no step older than one it took for the job; the new run needs its own job id."""
    url, options = store_from_env()
    url = run._durable or url or daemon_store(run)
    # With the peer tier on node-local roots, the agreement below picks the step and fetches it from
    # a partner first: fetching the store's newest here would pull from the bucket what a partner holds.
    peer_first = getattr(run.checkpointer, "node_ranks", None) is not None and bool(peers_from_env()[0])
    if url and local_rank() == 0 and not peer_first:
        try:
            held = Durable(open_store(url, options)).latest(run._job_id)
        except (StoreError, ValueError, OSError) as exc:
            log.warning("starting fresh: could not ask %s for checkpoints of job %s (%s)", url, run._job_id, exc)
            held = None
        if held is not None:
            raise StartRefused(
                f"starting fresh, but the store {url.split('?', 1)[0]} holds step {held} of job "
                f"{run._job_id}: give the new run its own job id (job_id= or $SPOTGUARD_JOB_ID), or "
                f"resume instead (no fresh=True, no ${FRESH_ENV})")
    if run.checkpointer._leads:
        found = layout.committed_dirs(run.checkpointer.root)
        for _, path in found:
            layout.remove_checkpoint(run.checkpointer.root, path)
        (run.checkpointer.root / layout.LATEST).unlink(missing_ok=True)
        if found:
            log.warning("starting fresh: removed %d checkpoint(s) under %s (newest: step %d)",
                        len(found), run.checkpointer.root, found[0][0])
    if run.agreement.enabled:
        distributed().barrier(group=run.agreement.process_group)


def plan(cadence: Any) -> str | None:
    """The cadence's plan for the start line: a fixed step count, or the MTBF it assumes."""
    fixed = getattr(cadence, "_fixed_steps", None)
    if fixed:
        return f"saves every {fixed} steps"
    mtbf = getattr(cadence, "mtbf_s", None)
    if isinstance(mtbf, (int, float)):
        return f"saves planned for an MTBF of {mtbf / 3600:.3g} h ({getattr(cadence, 'mtbf_source', 'given')})"
    return None
