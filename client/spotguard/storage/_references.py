"""Which objects a store's checkpoints still name: what :meth:`.durable.Durable.prune` must keep.

Referenced are the objects named by every manifest, every node part (of a step global or not: a
part of a step still to complete protects its objects), and every live pending note. Reading all
of them on each prune costs a GET per part: kept steps x N nodes, at every step. So:

- A global manifest of node parts names its parts (see :mod:`._parts`); the first prune that
  meets it writes the step's **index** ``jobs/<job>/refs/step-N.<token>.json`` (the sorted object
  hashes of all its parts) and every later prune, on any node, reads that one object instead.
- A tokened part's key names its incarnation, so its content (its files) never changes: each is
  read once per :class:`References` (the daemon keeps one) and remembered while it is listed.

A prune therefore costs one listing, one GET per plain manifest, per global manifest and per live
pending note, and a GET per part it has not read before: O(N) per step in all, the N parts of the
newest step read once. An unreadable manifest, part or index stops the collection (its objects are
unknown): nothing is deleted then; an index that does not parse is written again from the parts.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any, Callable

from spotguard.storage import _parts
from spotguard.storage._local import ManifestError, step_name, validate_manifest
from spotguard.storage.base import NotFound, Store, StoreError

__all__ = ["References", "REFS", "refs_key"]

log = logging.getLogger(__name__)

MANIFEST = re.compile(r"^jobs/([^/]+)/manifests/step-(\d{10})\.json$")
REFS = re.compile(r"^jobs/([^/]+)/refs/step-(\d{10})\.([0-9a-f]{16})\.json$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def refs_key(job: str, step: int, token: str) -> str:
    return f"jobs/{job}/refs/{step_name(step)}.{token}.json"


class Unreadable(Exception):
    """Some manifest, part or index could not be read: what it names is unknown."""


class References:
    """The referenced object hashes of a store, with what it learnt of immutable keys kept."""

    def __init__(self, store: Store, loads: Callable[[bytes], Any]) -> None:
        self.store, self._loads = store, loads
        self._known: dict[str, frozenset[str]] = {}
        """Hashes named by a tokened part or an index: their content never changes."""

    def collect(self, pending_ttl: float, *, live_only: bool = False) -> tuple[set[str] | None, list[str]]:
        """Hashes named by any manifest, node part or live pending note (only the notes and the
        parts with ``live_only``: what an upload in flight names), and the stale pending keys.
        ``None`` when something cannot be read."""
        keys = list(self.store.list("jobs/"))
        if live_only:
            keys = [k for k in keys if "/pending/" in k or _parts.PART.match(k)]
        listed = set(keys)
        if not live_only:  # forget what is no longer in the store
            self._known = {k: v for k, v in self._known.items() if k in listed}
        referenced: set[str] = set()
        stale: list[str] = []
        indexed: set[tuple[str, str, str | None]] = set()
        try:
            for key in keys:  # manifests and notes first: a global manifest's index covers its parts
                if found := MANIFEST.match(key):
                    hashes, token = self._manifest(key, found.group(1), int(found.group(2)), listed)
                    referenced |= hashes
                    if token:
                        indexed.add((found.group(1), found.group(2), token))
                elif "/pending/" in key:
                    if pending_is_stale(key, pending_ttl):
                        stale.append(key)
                    else:
                        referenced |= self._note(key)
            for key in keys:
                if (found := _parts.PART.match(key)) and found.group(1, 2, 4) not in indexed:
                    referenced |= self._part(key)
        except Unreadable as exc:
            log.warning("durable %s: not collecting garbage: cannot read %s", self.store.url, exc)
            return None, []
        return referenced, stale

    def _get(self, key: str) -> Any:
        """``key``'s JSON; None when it is gone (deleted since the listing)."""
        try:
            return self._loads(self.store.get_bytes(key))
        except NotFound:
            return None
        except (ManifestError, StoreError, ValueError) as exc:
            raise Unreadable(f"{key} ({exc})") from exc

    def _manifest(self, key: str, job: str, step: int, listed: set[str]) -> tuple[frozenset[str], str | None]:
        data = self._get(key)
        if data is None:
            return frozenset(), None
        manifest = self._files(data, key)
        if "parts" not in manifest:
            return frozenset(meta["sha256"] for meta in manifest["files"].values()), None
        section = manifest["parts"]
        token, nodes = (section.get("token"), section.get("nodes")) if isinstance(section, dict) else (None, None)
        if not (isinstance(token, str) and _parts.TOKEN.match(token) and type(nodes) is int
                and 1 <= nodes <= 1 << 20):
            raise Unreadable(f"{key} (bad parts section)")
        index = refs_key(job, step, token)
        hashes = self._known.get(index)
        if hashes is None and index in listed:
            hashes = self._index(index)
        if hashes is None:  # first met: read its parts (most were read while the step was not global)
            hashes = frozenset().union(*(self._part(_parts.part_key(job, step, k, token), required=True)
                                         for k in range(nodes)))
            self._known[index] = hashes
            try:
                self.store.put_bytes(index, json.dumps({"hashes": sorted(hashes)}).encode())
            except StoreError as exc:  # known here still; the next prune writes it
                log.info("durable %s: could not write the index %s: %s", self.store.url, index, exc)
        return hashes, token

    def _index(self, key: str) -> frozenset[str] | None:
        data = self._get(key)
        hashes = data.get("hashes") if isinstance(data, dict) else None
        if not (isinstance(hashes, list) and all(isinstance(h, str) and _HEX64.match(h) for h in hashes)):
            log.warning("durable %s: %s is not an index of object hashes; writing it again", self.store.url, key)
            return None
        self._known[key] = frozenset(hashes)
        return self._known[key]

    def _part(self, key: str, *, required: bool = False) -> frozenset[str]:
        if key in self._known:
            return self._known[key]
        data = self._get(key)
        if data is None:
            if required:
                raise Unreadable(f"{key} (a part its global manifest names is gone)")
            return frozenset()
        hashes = frozenset(meta["sha256"] for meta in self._files(data, key)["files"].values())
        if (found := _parts.PART.match(key)) and found.group(4):  # tokened: its files never change
            self._known[key] = hashes
        return hashes

    def _note(self, key: str) -> frozenset[str]:
        data = self._get(key)
        hashes = data.get("hashes", []) if isinstance(data, dict) else None
        if data is not None and not (isinstance(hashes, list) and all(isinstance(h, str) for h in hashes)):
            raise Unreadable(f"{key} (not a pending note)")
        return frozenset(hashes or ())

    @staticmethod
    def _files(data: Any, key: str) -> dict[str, Any]:
        try:
            return validate_manifest(data, key)
        except ManifestError as exc:
            raise Unreadable(f"{key} ({exc})") from exc


def pending_is_stale(key: str, ttl: float) -> bool:
    stamp = key.rsplit("/", 1)[-1].split("-", 1)[0]
    return not stamp.isdigit() or int(stamp) < time.time() - ttl
