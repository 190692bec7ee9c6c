"""The fresh-node case: fetch the newest durable checkpoint when nothing local is as new.

A spot node's local disk dies with it. When the identical command starts on a replacement node,
:func:`restore_newer` compares the newest committed local checkpoint with the store's ``latest`` and,
when the store is ahead, restores it into the local root (parallel downloads, every sha256 verified, the
same rename commit as a local save; a corrupt durable checkpoint is skipped for the previous one).
The checkpoint engine's ordinary load-latest then finds it. With the daemon or without it, the code
path is this one.

Where the store is comes from, in order: an explicit URL, ``$SPOTGUARD_STORAGE__URL`` (the daemon's
own setting, so one environment serves both), or the daemon's ``status`` reply. The URL ``none``
(:data:`NO_STORE`, the daemon's ``storage.url = "none"``) means there is no durable store.

Exceptions: :class:`~spotguard.storage.base.StoreError` subclasses from the store; callers that must not
fail on an unreachable bucket (the training loop) catch them and go on with what is local.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

from spotguard.storage._local import ManifestError, read_manifest
from spotguard.storage.base import StoreError, StoreOptions, open_store
from spotguard.storage.durable import Durable

__all__ = ["restore_newer", "local_latest_step", "store_from_env", "no_store", "DEFAULT_JOB",
           "NO_STORE"]

log = logging.getLogger(__name__)

DEFAULT_JOB = "default"
"""The durable job name of checkpoints committed without a job id (the daemon uses the same)."""
NO_STORE = "none"
"""The store URL that says there is no durable store: nothing is uploaded, nothing restored."""


def no_store(url: str | None) -> bool:
    """Whether ``url`` names no durable store: unset, empty or ``none`` (in any case)."""
    return not url or url.strip().lower() == NO_STORE


def local_latest_step(root: Path) -> int | None:
    """The newest step under ``root`` whose directory holds a readable manifest, or None."""
    steps = []
    for path in root.glob("step-*") if root.is_dir() else ():
        try:
            steps.append(read_manifest(path)["step"])
        except (ManifestError, OSError):
            continue
    return max(steps, default=None)


def store_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str | None, StoreOptions]:
    """The store URL and options from the daemon's environment variables (``SPOTGUARD_STORAGE__*``);
    the URL is None when unset or ``none``."""
    prefix = "SPOTGUARD_STORAGE__"
    options = StoreOptions(
        endpoint_url=environ.get(prefix + "ENDPOINT_URL") or None,
        azure_account=environ.get(prefix + "AZURE_ACCOUNT") or None,
        azure_connection_string=environ.get(prefix + "AZURE_CONNECTION_STRING") or None,
    )
    url = environ.get(prefix + "URL")
    return (None if no_store(url) else url), options


def restore_newer(root: str | os.PathLike[str], job_id: str, url: str | None,
                  options: StoreOptions | None = None) -> Path | None:
    """Restore the store's newest checkpoint of ``job_id`` into ``root`` if it is newer than every
    local one; return the restored directory, or None when the local copy is as new (or the store
    holds nothing for the job, or ``url`` names no store: ``none``)."""
    if no_store(url):
        return None
    root = Path(root)
    try:
        durable = Durable(open_store(url, options))
    except ValueError as exc:  # a bad URL must not stop training either
        raise StoreError(str(exc)) from exc
    job = job_id or DEFAULT_JOB
    remote = durable.latest(job)
    if remote is None:
        return None
    local = local_latest_step(root)
    if local is not None and local >= remote:
        return None
    log.warning("local checkpoints end at step %s, the store %s holds step %d: restoring it",
                local, url, remote)
    root.mkdir(parents=True, exist_ok=True)
    return durable.restore(job, root)
