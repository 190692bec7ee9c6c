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

Transient store errors are retried for ``Durable.retry_seconds`` (60 s) in all, as uploads are
(:mod:`._restore`): one reset or truncated reply does not send a fresh node back to step 0.

Exceptions: :class:`~spotguard.storage.base.StoreError` subclasses from the store; callers that must not
fail on an unreachable bucket (the training loop) catch them and go on with what is local. When the
store held, or may have held, a checkpoint newer than every local one and it was not restored, the
error is a :class:`RestoreFailed` naming both steps: training from the older step loses work, so
callers say it loudly (``Run`` logs an error and records a ``restore_failed`` event).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Mapping, Sequence

from spotguard.storage import _restore
from spotguard.storage._local import ManifestError, read_manifest
from spotguard.storage.base import StoreError, StoreOptions
from spotguard.storage.durable import Durable
from spotguard.storage.registry import open_store

__all__ = ["restore_newer", "local_latest_step", "store_from_env", "no_store", "DEFAULT_JOB",
           "NO_STORE", "RestoreFailed"]

log = logging.getLogger(__name__)

DEFAULT_JOB = "default"
"""The durable job name of checkpoints committed without a job id (the daemon uses the same)."""
NO_STORE = "none"
"""The store URL that says there is no durable store: nothing is uploaded, nothing restored."""


class RestoreFailed(StoreError):
    """The store held (``store_step``), or may have held (None: its ``latest`` could not be read),
    a checkpoint newer than the local ``local_step`` (None: no local checkpoint), and it was not
    restored; ``__cause__`` is the store's error."""

    def __init__(self, message: str, store_step: int | None, local_step: int | None) -> None:
        super().__init__(message)
        self.store_step, self.local_step = store_step, local_step


def _local(step: int | None) -> str:
    return "every local checkpoint (none)" if step is None else f"the local step {step}"


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
                  options: StoreOptions | None = None, ranks: Sequence[int] | None = None,
                  world_size: int | None = None) -> Path | None:
    """Restore the store's newest checkpoint of ``job_id`` into ``root`` if it is newer than every
    local one; return the restored directory, or None when the local copy is as new (or the store
    holds nothing for the job, or ``url`` names no store: ``none``). ``ranks``: a node of node-local
    roots fetches only its ranks' parts and rank 0's (``world_size``: the job's; sharded files are
    left to the resharding load when it differs from the saved one)."""
    if no_store(url):
        return None
    if not job_id:
        raise ValueError("restore_newer needs a job id: without one every job would share the "
                         f"store's {DEFAULT_JOB!r} checkpoints")
    root, options = Path(root), StoreOptions.of(options)
    try:
        durable = Durable(open_store(url, options), retry_seconds=options.retry_seconds)
    except ValueError as exc:  # a bad URL must not stop training either
        raise StoreError(str(exc)) from exc
    job, local = job_id, local_latest_step(root)
    retry = _restore.Retry(time.monotonic() + durable.retry_seconds)
    try:
        remote = retry(lambda: durable.latest(job), f"read the latest checkpoint of {job}")
    except StoreError as exc:
        raise RestoreFailed(f"cannot tell whether {durable.store.url} holds a checkpoint of {job!r} newer "
                            f"than {_local(local)}: {exc}", None, local) from exc
    if remote is None:
        return None
    if local is not None and local >= remote:
        return None
    log.warning("%s, the store %s (job %s) holds step %d: restoring it",
                f"local checkpoints end at step {local}" if local is not None else
                f"no local checkpoint under {root}", url.split("?", 1)[0], job, remote)
    root.mkdir(parents=True, exist_ok=True)
    try:
        path = durable.restore(job, root, retry_until=retry.until, ranks=ranks, world_size=world_size)
    except StoreError as exc:
        raise RestoreFailed(f"{durable.store.url} holds step {remote} of {job!r}, newer than "
                            f"{_local(local)}, and it was not restored: {exc}", remote, local) from exc
    return path
