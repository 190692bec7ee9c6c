"""Node parts of a checkpoint taken with node-local roots, and the global manifest that names them.

Each node commits its own ranks' parts under a node-local manifest with a ``node`` section (see
:mod:`spotguard.checkpoint.nodes`); its daemon uploads the objects, then the part manifest at
``jobs/<job>/parts/step-N/node-<k>.<token>.json``, then lists that step's parts. The *token* names
the part's incarnation (:func:`token`): what every node of one save agrees on and a relaunch's save
of the same step does not (step, job, world size, node count and the state digest, which hashes
every rank's digest). Parts of one save therefore sort themselves by key: a listing alone tells
whether every node ``0 .. nodes-1`` of an incarnation is in the store, and a leftover part of an
earlier launch is never mixed in, never overwritten, and never read.

Whoever finds the set complete writes the **global manifest**, which names the parts instead of
copying them (:func:`global_manifest`): the incarnation's token, the node count, and node 0's
``layout`` (which node holds each rank, as runs), with node 0's metadata. Completing a step of N
nodes therefore costs one listing, one GET of node 0's part and one PUT, whatever N is; two
daemons finishing together write the same bytes. A reader resolves the parts it needs
(:func:`resolve`): every part for a whole restore or a verify, or only the parts of some ranks and
rank 0's (a fresh node); each is checked against the global manifest (token, index, step, and its
ranks against the layout), and a whole resolve checks that the parts cover the world's ranks once.

Bytes: a part lists its own ranks' files only (no per-rank digests of the whole world); only node
0's part carries the layout (O(world) bytes once a step). Only the canonical key counts
(``node-00.<token>.json`` is not node 0). Parts without a token (written by daemons before this
layout) are pruned like the others but never assembled.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable, Iterable

from spotguard.storage._local import ManifestError, step_name, validate_manifest
from spotguard.storage.base import IntegrityError, Store

__all__ = ["PART", "part_key", "parts_prefix", "token", "uploaded_part", "listed", "global_manifest",
           "resolve", "node_of"]

PART = re.compile(r"^jobs/([^/]+)/parts/step-(\d{10})/node-(0|[1-9]\d{0,5})(?:\.([0-9a-f]{16}))?\.json$")
"""A part's key: job, step, node index, and the incarnation token (None: an untokened older part)."""
_SAME = ("step", "world_size", "digest", "job_id")
TOKEN = re.compile(r"^[0-9a-f]{16}$")
"""An incarnation token as keys and global manifests carry it."""
_NODE_ONLY = ("node", "durable", "files", "parts")
"""What a part holds that is its node's own, or the global manifest's: never copied between them."""


def parts_prefix(job: str, step: int) -> str:
    return f"jobs/{job}/parts/{step_name(step)}/"


def part_key(job: str, step: int, node: int, token_: str) -> str:
    return f"{parts_prefix(job, step)}node-{int(node)}.{token_}.json"


def _ints(*values: Any) -> bool:
    return all(type(v) is int for v in values)  # bools are not node numbers


def _runs(layout: Any, world: int, nodes: int) -> dict[int, list[int]] | None:
    """The ranks of each node from a layout (``[[node, count], ...]`` over ranks 0..world-1), or
    None when it is malformed or does not name every node."""
    if not isinstance(layout, list) or len(layout) > world:
        return None
    held: dict[int, list[int]] = {}
    rank = 0
    for run in layout:
        if not (isinstance(run, list) and len(run) == 2 and _ints(*run) and 0 <= run[0] < nodes
                and 1 <= run[1] <= world - rank):
            return None
        held.setdefault(run[0], []).extend(range(rank, rank + run[1]))
        rank += run[1]
    return held if rank == world and set(held) == set(range(nodes)) else None


def node_of(manifest: dict[str, Any], where: str) -> dict[str, Any]:
    """A node-local manifest's ``node`` section, checked: index < nodes, ranks inside the world,
    files of its own ranks only, and a layout (when present) that gives this node these ranks."""
    node, world = manifest.get("node"), manifest.get("world_size")
    ok = isinstance(node, dict) and type(world) is int and world >= 1
    ok = ok and _ints(node.get("index"), node.get("nodes"), node.get("leader"))
    ok = ok and 0 <= node["index"] < node["nodes"] <= world and isinstance(node.get("ranks"), list)
    ok = ok and bool(node["ranks"]) and _ints(*node["ranks"]) and all(0 <= r < world for r in node["ranks"])
    digests = node.get("digests", []) if ok else None  # a local manifest lists every rank's
    ok = ok and node["leader"] in node["ranks"] and isinstance(digests, list) and len(digests) in (0, world)
    if not ok:
        raise ManifestError(f"{where}: bad node section")
    if "layout" in node:
        held = _runs(node["layout"], world, node["nodes"])
        if held is None or held[node["index"]] != sorted(node["ranks"]):
            raise ManifestError(f"{where}: its layout does not give node {node['index']} its ranks")
    prefixes = tuple(f"rank-{r}/" for r in node["ranks"])
    if not all(rel.startswith(prefixes) for rel in manifest["files"]):
        raise ManifestError(f"{where}: a node part lists files of ranks it does not hold")
    return node


def token(part: dict[str, Any]) -> str:
    """The incarnation of a (checked) part: a hash of what all nodes of its save agree on."""
    same = [part.get(f) for f in _SAME] + [part["node"]["nodes"]]
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:16]


def uploaded_part(manifest: dict[str, Any], durable: dict[str, Any]) -> dict[str, Any]:
    """The part manifest a node uploads: its local manifest without every rank's digest (the state
    ``digest`` stands for them) and, but on node 0, without the layout; plus the ``durable`` section."""
    keep = lambda k: k != "digests" and (k != "layout" or manifest["node"]["index"] == 0)  # noqa: E731
    node = {k: v for k, v in manifest["node"].items() if keep(k)}
    return {**manifest, "node": node, "durable": durable}


def listed(store: Store, job: str, step: int) -> dict[str, dict[int, str]]:
    """The step's tokened parts in the store: ``{token: {node index: key}}`` (one LIST)."""
    found: dict[str, dict[int, str]] = {}
    for key in store.list(parts_prefix(job, step)):
        if (m := PART.match(key)) and m.group(1) == job and m.group(4):
            found.setdefault(m.group(4), {})[int(m.group(3))] = key
    return found


def read_part(store: Store, key: str, index: int, step: int, token_: str, max_bytes: int,
              loads: Callable[[bytes], Any]) -> dict[str, Any]:
    """The part under ``key``, checked to be node ``index``'s of ``step`` and incarnation ``token_``."""
    try:
        part = validate_manifest(loads(store.get_bytes(key, max_size=max_bytes)), key)
    except IntegrityError as exc:
        raise ManifestError(f"{key}: implausible part manifest: {exc}") from exc
    if node_of(part, key)["index"] != index or part["step"] != step or token(part) != token_:
        raise ManifestError(f"{key}: its node, step or incarnation differs from its key")
    return part


def global_manifest(first: dict[str, Any], own: dict[str, Any], step: int) -> dict[str, Any]:
    """The global manifest of a complete set, from node 0's part ``first`` (whoever completes the
    set writes the same bytes) and the completing node's ``own`` part, whose ranks are checked
    against node 0's layout."""
    node = first["node"]
    if "layout" in node:
        held = _runs(node["layout"], first["world_size"], node["nodes"])
        if held is None or held.get(own["node"]["index"]) != sorted(own["node"]["ranks"]):
            _disagree(first["job_id"], step, "ranks (not every rank exactly once)")
    meta = {k: v for k, v in first.items() if k not in _NODE_ONLY}
    parts = {"token": token(first), "nodes": node["nodes"]}
    if "layout" in node:
        parts["layout"] = node["layout"]
    durable = {"version": 2, "name": step_name(step), "objects": first.get("durable", {}).get("objects"),
               "nodes": node["nodes"]}
    return {**meta, "files": {}, "parts": parts, "durable": durable}


def resolve(store: Store, job: str, manifest: dict[str, Any], where: str, max_bytes: int,
            loads: Callable[[bytes], Any], ranks: Iterable[int] | None = None,
            mapper: Callable[..., Any] = map) -> dict[str, Any]:
    """A global manifest that names parts, with its ``files`` filled in from them: every part, or
    (``ranks``) only the parts that hold those ranks and rank 0 (a fresh node's). Raises
    :class:`ManifestError` for a malformed section, a part that is missing or does not match."""
    section, world, step = manifest.get("parts"), manifest.get("world_size"), manifest["step"]
    ok = isinstance(section, dict) and isinstance(section.get("token"), str) and bool(TOKEN.match(section["token"]))
    ok = ok and type(world) is int and world >= 1 and _ints(section.get("nodes")) and 1 <= section["nodes"] <= world
    held = _runs(section.get("layout"), world, section["nodes"]) if ok and "layout" in section else None
    if not ok or ("layout" in section and held is None):
        raise ManifestError(f"{where}: bad parts section")
    nodes, token_ = section["nodes"], section["token"]
    wanted = set(range(nodes))
    if ranks is not None and held is not None:
        wanted = {k for k, rs in held.items() if set(rs) & {0, *ranks}}

    def read(index: int) -> dict[str, Any]:
        part = read_part(store, part_key(job, step, index, token_), index, step, token_, max_bytes, loads)
        if held is not None and sorted(part["node"]["ranks"]) != held[index]:
            raise ManifestError(f"{where}: node {index}'s part holds other ranks than the layout says")
        return part

    parts = dict(zip(sorted(wanted), mapper(read, sorted(wanted))))
    files: dict[str, dict] = {}
    covered: list[int] = []
    for index in sorted(parts):
        covered += parts[index]["node"]["ranks"]
        files.update(parts[index]["files"])
    if wanted == set(range(nodes)) and sorted(covered) != list(range(world)):
        _disagree(job, step, "ranks (not every rank exactly once)")
    meta = {k: v for k, v in parts[min(parts)].items() if k not in _NODE_ONLY}
    return {**meta, **{k: v for k, v in manifest.items() if k not in ("files", "parts")},
            "files": dict(sorted(files.items()))}


def _disagree(job: str, step: int, what: str) -> None:
    raise ManifestError(f"jobs/{job}: the node parts of {step_name(step)} disagree on {what}")


def dumps(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1).encode()
