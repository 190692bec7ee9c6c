"""The start of a :class:`spotguard.run.Run`: fetch a newer checkpoint from the durable store (a
fresh node), then load the newest local one, refusing one that does not fit the state."""

from __future__ import annotations

import logging
from typing import Any

from spotguard import _jobid
from spotguard._run_common import fetch_common_step
from spotguard._run_parts import distributed, local_rank
from spotguard.checkpoint import CheckpointCorruptError, CheckpointError
from spotguard.checkpoint.load import read_manifest
from spotguard.storage import StoreError, restore_newer, store_from_env
from spotguard.storage.fresh_node import RestoreFailed

__all__ = ["load_latest", "restore_from_store"]

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
    if url and local_rank() == 0:
        try:
            restore_newer(run.checkpointer.root, run._job_id, url, options,
                          ranks=getattr(run.checkpointer, "node_ranks", None))
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


def daemon_store(run: Any) -> str | None:
    uploads = (run.guard.daemon_status() or {}).get("uploads") or {}
    store = uploads.get("store")
    return store if isinstance(store, str) and "://" in store else None
