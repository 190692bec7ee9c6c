"""Node parts of a checkpoint taken with node-local roots, and the global manifest made of them.

Each node commits its own ranks' parts under a node-local manifest with a ``node`` section (see
:mod:`spotguard.checkpoint.nodes`); its daemon uploads the objects, then the part manifest at
``jobs/<job>/parts/step-N/node-<k>.json``, then lists that step's parts. Whoever finds the set
complete (every node ``0 .. nodes-1`` of one incarnation, their ranks covering the world once)
writes the global manifest and the pointer. Cost: a node whose listing lacks some node's part stops
after that one LIST; only a node that lists every part reads the others (O(N) per step in all when
the nodes finish one after another, not O(N²)).

Incarnations: a part's incarnation is what every node of one save agrees on and a relaunch's save of
the same step does not (:func:`incarnation`: step, job, world size, node count and the state digest,
which hashes every rank's digest; an uploaded part does not list those, :func:`uploaded_part`). Only parts of the uploader's incarnation are assembled; a leftover part of an earlier
launch (another node count, other digests) is superseded, never mixed in nor fatal, and the new
launch's part of that node overwrites it. Only the canonical key ``node-<k>.json`` counts
(``node-00.json`` is not node 0). Two daemons finishing together
write the same bytes (nothing in the global manifest depends on the writer or the time), so the race
is harmless; a set that is not complete writes nothing, so ``manifests/`` never names a missing part.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from spotguard.storage._local import ManifestError, step_name, validate_manifest
from spotguard.storage.base import IntegrityError, Store

__all__ = ["PART", "part_key", "parts_prefix", "assemble", "uploaded_part"]

PART = re.compile(r"^jobs/([^/]+)/parts/step-(\d{10})/node-(0|[1-9]\d{0,5})\.json$")
_SAME = ("step", "world_size", "digest", "job_id")


def parts_prefix(job: str, step: int) -> str:
    return f"jobs/{job}/parts/{step_name(step)}/"


def part_key(job: str, step: int, node: int) -> str:
    return f"{parts_prefix(job, step)}node-{int(node)}.json"


def node_of(manifest: dict[str, Any], where: str) -> dict[str, Any]:
    """A node-local manifest's ``node`` section, checked: index < nodes, ranks inside the world."""
    node, world = manifest.get("node"), manifest.get("world_size")
    ok = isinstance(node, dict) and type(world) is int and world >= 1
    ints = lambda *v: all(type(x) is int for x in v)  # noqa: E731 - bools are not node numbers
    ok = ok and ints(node.get("index"), node.get("nodes"), node.get("leader"))
    ok = ok and 0 <= node["index"] < node["nodes"] <= world and isinstance(node.get("ranks"), list)
    ok = ok and bool(node["ranks"]) and ints(*node["ranks"]) and all(0 <= r < world for r in node["ranks"])
    digests = node.get("digests", []) if ok else None  # older uploaded parts list every rank's
    ok = ok and node["leader"] in node["ranks"] and isinstance(digests, list) and len(digests) in (0, world)
    if not ok:
        raise ManifestError(f"{where}: bad node section")
    prefixes = tuple(f"rank-{r}/" for r in node["ranks"])
    if not all(rel.startswith(prefixes) for rel in manifest["files"]):
        raise ManifestError(f"{where}: a node part lists files of ranks it does not hold")
    return node


def incarnation(part: dict[str, Any]) -> str:
    """The save a (checked) part belongs to: what all nodes of that save agree on. The state
    ``digest`` is the hash of every rank's digest in rank order, so a part needs not list them."""
    same = [part.get(f) for f in _SAME] + [part["node"]["nodes"]]
    return json.dumps(same, sort_keys=True)


def uploaded_part(manifest: dict[str, Any], durable: dict[str, Any]) -> dict[str, Any]:
    """The part manifest a node uploads: its local manifest without every rank's digest (O(world)
    bytes in each of N parts; the state ``digest`` stands for them), plus the ``durable`` section."""
    node = {k: v for k, v in manifest["node"].items() if k != "digests"}
    return {**manifest, "node": node, "durable": durable}


def assemble(store: Store, job: str, step: int, max_bytes: int,
             loads: Callable[[bytes], Any], own: dict[str, Any] | None = None,
             mapper: Callable[..., Any] = map) -> dict[str, Any] | None:
    """The global manifest of ``step`` once every node's part of ``own``'s incarnation (the part
    the caller uploaded; default: the newest uploaded part's) is in the store, else None. Raises
    :class:`ManifestError` when a part is malformed or the parts of one incarnation do not cover
    the world's ranks once (nothing is written then). ``mapper`` reads the parts (a thread pool's
    ``map`` reads them in parallel)."""
    keys = {int(m.group(3)): key for key in store.list(parts_prefix(job, step))
            if (m := PART.match(key)) and m.group(1) == job}
    if own is not None and not set(range(own["node"]["nodes"])) <= set(keys):
        return None  # one LIST and no GET while some node's part is missing (all but the last node)

    def read(index: int, key: str) -> dict[str, Any]:
        try:
            part = validate_manifest(loads(store.get_bytes(key, max_size=max_bytes)), key)
        except IntegrityError as exc:
            raise ManifestError(f"{key}: implausible part manifest: {exc}") from exc
        if node_of(part, key)["index"] != index or part["step"] != step:
            raise ManifestError(f"{key}: its node or step differs from its key")
        return part

    mine = own["node"]["index"] if own is not None else None  # just written by the caller: not read back
    others = sorted((index, key) for index, key in keys.items() if index != mine)
    parts = dict(zip((index for index, _ in others), mapper(lambda item: read(*item), others)))
    if own is not None:
        parts[mine] = own
    if not parts:
        return None
    if own is None:
        own = max(parts.values(), key=lambda p: _uploaded(p))
    wanted = incarnation(own)
    found = {k: p for k, p in parts.items() if incarnation(p) == wanted}
    nodes = own["node"]["nodes"]
    if set(found) != set(range(nodes)):
        return None  # this incarnation's other parts are still to come (others' are superseded)
    first = found[0]  # whichever node completes the set writes the same bytes
    ranks: list[int] = []
    files: dict[str, dict] = {}
    for k in range(nodes):
        part = found[k]
        ranks += part["node"]["ranks"]
        files.update(part["files"])
    if sorted(ranks) != list(range(first["world_size"])):
        return _disagree(job, step, "ranks (not every rank exactly once)")
    meta = {k: v for k, v in first.items() if k not in ("node", "durable", "files")}
    uploaded = max(_uploaded(p) for p in found.values())
    durable = {"version": 1, "name": step_name(step), "objects": first.get("durable", {}).get("objects"),
               "uploaded": uploaded, "nodes": nodes}
    return {**meta, "files": dict(sorted(files.items())), "durable": durable}


def _uploaded(part: dict[str, Any]) -> float:
    durable = part.get("durable")
    value = durable.get("uploaded", 0) if isinstance(durable, dict) else 0
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _disagree(job: str, step: int, what: str) -> None:
    raise ManifestError(f"jobs/{job}: the node parts of {step_name(step)} disagree on {what}")


def dumps(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1).encode()
