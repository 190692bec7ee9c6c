"""A durable checkpoint's sharded (DCP) files, read piecewise: what a resharding load on node-local
roots needs from the store.

An FSDP2 job saved on node-local roots holds each node's ranks' shards on that node only; the store
holds them all once the step is global. A relaunch on another number of ranks (elastic: 2 x 2 saved,
1 x 3 or 3 x 1 resumed) reshards every tensor from the saved chunks that overlap each rank's new
shard. :class:`StoreShards` gives the checkpoint engine (:func:`spotguard.checkpoint.sharded.load_entries`)
the other nodes' parts of that step without fetching them whole: each ``dcp/.metadata`` (small) is read
whole and checked against the manifest's sha256; a chunk is one ranged GET of its bytes, checked
against the chunk's own sha256 that the save recorded (the manifest entry's ``ranges``); a chunk the
save did not record is refused, never read unchecked. Transient errors are retried for
``Durable.retry_seconds``, as a restore's are. The checkpoint engine knows only the two methods, not
the store.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

from spotguard.storage._keys import object_key
from spotguard.storage._restore import Retry
from spotguard.storage.base import IntegrityError

__all__ = ["StoreShards", "from_store"]


class StoreShards:
    """The files of ``step`` of ``job`` in ``durable``'s store, read whole or by chunk, verified."""

    def __init__(self, durable: Any, job: str, step: int) -> None:
        self.durable, self.job, self.step = durable, job, step
        self._files: dict[str, dict[str, Any]] | None = None
        self._retry = Retry(time.monotonic() + durable.retry_seconds)

    def files(self) -> dict[str, dict[str, Any]]:
        """Every file of the step (the global manifest with all its parts resolved)."""
        if self._files is None:
            manifest = self._retry(lambda: self.durable.manifest(self.job, self.step),
                                   f"read the manifest of step {self.step} of {self.job}")
            self._files = manifest["files"]
        return self._files

    def read_whole(self, rel: str) -> bytes:
        meta = self._meta(rel)
        data = self._retry(lambda: self.durable.store.get_bytes(object_key(meta["sha256"]), max_size=meta["size"]),
                           f"read {rel} of step {self.step}")
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise IntegrityError(f"{rel} of step {self.step}: the store's object does not hash to its address")
        return data

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """The chunk of ``rel`` at ``offset``, ``length`` bytes long, as the save recorded it."""
        meta = self._meta(rel)
        sha = next((r[2] for r in meta.get("ranges") or () if isinstance(r, list) and len(r) == 3
                    and r[0] == offset and r[1] == length), None)
        if not isinstance(sha, str):
            raise IntegrityError(f"{rel} of step {self.step}: no recorded chunk at [{offset}, +{length}); "
                                 "not read unchecked")
        data = self._retry(lambda: self.durable.store.get_range(object_key(meta["sha256"]), offset, length),
                           f"read {rel} [{offset}, +{length}) of step {self.step}")
        if hashlib.sha256(data).hexdigest() != sha:
            raise IntegrityError(f"{rel} of step {self.step}: the chunk at [{offset}, +{length}) does not "
                                 "hash to the sha256 its save recorded")
        return data

    def _meta(self, rel: str) -> dict[str, Any]:
        meta = self.files().get(rel)
        if meta is None:
            raise IntegrityError(f"step {self.step} of {self.job} in the store lists no {rel}")
        return meta


def from_store(url: str, job: str, options: Any = None) -> Callable[[int], StoreShards]:
    """``remote_shards(step)`` for :attr:`spotguard.checkpoint.Checkpointer.remote_shards`: the
    store at ``url`` (its options: a :class:`~spotguard.storage.base.StoreOptions` or settings),
    checkpoints of ``job``. ``spotguard.Run`` sets it when the job has a store."""
    from spotguard.storage.base import StoreOptions
    from spotguard.storage.durable import Durable
    from spotguard.storage.registry import open_store

    def shards(step: int) -> StoreShards:
        return StoreShards(Durable(open_store(url, StoreOptions.of(options))), job, step)

    return shards
