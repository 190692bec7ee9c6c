"""Node-local roots at a relaunch: agree on the newest step every rank holds or can fetch from the store.

Each node keeps its own checkpoints, and its daemon uploads its part; a step is global once every
node's part is in the store. When a node's daemon died, the nodes' local checkpoints drift apart
from the store's: a surviving node may hold only steps newer than the last global one (its
retention deleted the older ones), while a fresh node fetched that global step. Without a step in
common every rank used to refuse to start.

:func:`fetch_common_step` runs on every rank, collectively, after the fresh-node fetch and before
the load: each rank offers the steps its node holds and the steps the store holds globally, the
ranks agree (``all_reduce`` of ints, as the load does) on the newest step every rank can have, and
the node leaders lacking it fetch it (only their ranks' parts, as a fresh node does). Steps a node
holds that are newer than the agreed one are from a timeline the relaunch abandons: they are
renamed ``abandoned-step-N-<time>`` (kept, never loaded, never pruned as checkpoints; the next relaunch
that sets steps aside deletes them), so that the relaunch's own step N never mixes with them; only once every node has the agreed step. Store
errors leave the store out of the offer (with a warning) and the load goes on with what is local.

The peer tier (``SPOTGUARD_PEER__PARTNERS``, :mod:`spotguard.storage.peer`): the steps the
partners hold of this node's slot (its ranks) count as fetchable too, and a node lacking the agreed
step fetches it from a partner first, from the store when no partner gives a copy that verifies.
``run._tier`` says where the resumed step came from: ``local``, ``peer`` or ``bucket``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from spotguard.checkpoint import layout
from spotguard.storage import StoreError
from spotguard.storage.base import StoreOptions
from spotguard.storage.durable import Durable
from spotguard.storage.fresh_node import DEFAULT_JOB
from spotguard.storage.peer import PeerClient, PeerError, newest_from_peers, peers_from_env, slot_of
from spotguard.storage.registry import open_store

__all__ = ["fetch_common_step", "mark_fetched", "fetched_tier"]

log = logging.getLogger("spotguard.run")

NONE = -1
FETCHED = ".fetched"
"""Written by a node leader into a step it fetched (``peer`` or ``bucket``), so that every rank of the
node can say where its resumed step came from (:func:`fetched_tier`)."""
_IMPORTED = time.time()


def mark_fetched(step_dir: Path, tier: str) -> None:
    try:
        (Path(step_dir) / FETCHED).write_text(tier)
    except OSError as exc:  # a report only
        log.debug("cannot mark %s as fetched: %s", step_dir, exc)


def fetched_tier(step_dir: Any) -> str | None:
    """``peer`` or ``bucket`` when this launch fetched ``step_dir`` (its marker is newer than this
    process's import of spotguard), else None: the step was on the node's disk already."""
    try:
        marker = Path(step_dir) / FETCHED
        if marker.stat().st_mtime >= _IMPORTED - 1.0:
            tier = marker.read_text(errors="replace").strip()
            return tier if tier in ("peer", "bucket") else None
    except (OSError, TypeError):
        pass
    return None


def fetch_common_step(run: Any, url: str | None, options: StoreOptions | None) -> int | None:
    """Collective on node-local roots (every rank calls it; a no-op otherwise): make the newest
    step every rank holds or can fetch present on every node; return it (None: no such step)."""
    ckpt = run.checkpointer
    coord = getattr(ckpt, "_coord", None)
    if coord is None or not coord.node_local:
        return None
    job = run._job_id or DEFAULT_JOB
    local = {step for step, _ in layout.committed_dirs(ckpt.root)}
    durable, remote = _store_steps(url, options, job)
    partners, secret = peers_from_env()
    slot = slot_of(ckpt.node_ranks) if partners and ckpt.node_ranks else None
    peers = newest_from_peers(partners, secret, job, slot) if slot else {}
    step = agree_step(coord, local | remote | set(peers))
    if step is None:
        return None
    if step not in local:  # what the node leader's fetch below will say (it is the one that knows)
        run._tier = "peer" if step in peers else "bucket"
    ok = 1
    if step not in local and ckpt._leads:
        if slot is not None and step not in peers:  # the tier is on, and no partner has it
            log.warning("node-local roots: no partner (%s) holds step %d of %s; %s", ", ".join(partners), step,
                        slot, f"fetching it from the store {durable.store.url}" if step in remote else
                        "nor does the store")
        ok = int(_fetch(run, job, step, local, peers.get(step), secret, slot, durable if step in remote else None))
    if not coord.agree(ok, "min"):  # every node's fetch is done before anyone loads
        return None  # the load says what each rank holds; nothing was set aside
    if ckpt._leads:
        _set_aside(ckpt.root, step)
    coord.agree(0, "sum")  # set aside before any rank of the node lists its checkpoints
    return step


def _fetch(run: Any, job: str, step: int, local: set[int], peer: str | None, secret: str | None,
           slot: str | None, durable: Any) -> bool:
    """Fetch ``step`` of this node's ranks: from the partner ``peer`` holding it, else from the
    store (``durable``); whether it is here now."""
    ckpt, newest = run.checkpointer, max(local, default=None)
    if peer is not None:
        started = time.monotonic()
        log.warning("node-local roots: the ranks agree on step %d, which this node lacks (its newest: %s); "
                    "fetching it from the peer %s", step, newest, peer)
        try:
            with PeerClient(peer, secret, job) as client:
                mark_fetched(client.fetch(slot, step, ckpt.root), "peer")
            log.warning("node-local roots: step %d (%s) restored from the peer %s in %.1f s", step, slot, peer,
                        time.monotonic() - started)
            run._tier, run._restored_from = "peer", f"restored from the peer {peer}:"
            return True
        except (PeerError, OSError) as exc:
            log.error("could not fetch step %d from the peer %s (%s)%s", step, peer, exc,
                      "; trying the store" if durable is not None else "")
    if durable is None:
        return False
    try:
        log.warning("node-local roots: the ranks agree on step %d, which this node lacks (its newest: "
                    "%s); fetching it from %s", step, newest, durable.store.url)
        mark_fetched(durable.restore(job, ckpt.root, step=step, ranks=ckpt.node_ranks,
                                     world_size=ckpt.world_size), "bucket")
        run._tier, run._restored_from = "bucket", f"restored from the store {durable.store.url}:"
        return True
    except (StoreError, OSError) as exc:
        log.error("could not fetch step %d from the store: %s", step, exc)
        return False


def agree_step(coord: Any, have: set[int]) -> int | None:
    """The newest step in every rank's ``have`` (collective): each round, each rank offers its newest
    step below the last offer, the lowest offer is checked against every rank."""
    below = 10**10
    while True:
        step = coord.agree(max((s for s in have if s < below), default=NONE), "min")
        if step == NONE:
            return None
        if coord.agree(int(step in have), "min"):
            return step
        below = step


def _store_steps(url: str | None, options: StoreOptions | None, job: str) -> tuple[Any, set[int]]:
    if not url:
        return None, set()
    try:
        durable = Durable(open_store(url, StoreOptions.of(options)))
        return durable, set(durable.list(job))
    except (StoreError, ValueError, OSError) as exc:
        log.warning("cannot list the store's checkpoints of %s (%s); agreeing on local steps only", job, exc)
        return None, set()


def _set_aside(root: Path, step: int) -> None:
    """Rename the local steps newer than ``step`` (an abandoned timeline) out of the checkpoints' way.
    The steps an earlier relaunch set aside are deleted then: one abandoned timeline is kept at most,
    so that relaunch after relaunch cannot fill the node's disk."""
    older = [p for p in root.glob("abandoned-step-*") if p.is_dir() and not p.is_symlink()]
    moved = False
    for newer, path in layout.committed_dirs(root):
        if newer <= step:
            break
        aside = root / f"abandoned-{path.name}-{int(time.time())}"
        os.rename(path, aside)
        moved = True
        log.warning("node-local roots: the relaunch resumes from step %d; this node's newer step %d is from "
                    "the abandoned run and was moved to %s", step, newer, aside)
    if moved and older:
        for path in older:
            shutil.rmtree(path, ignore_errors=True)
        log.warning("node-local roots: deleted %d step(s) an earlier relaunch had set aside (%s): one abandoned "
                    "run is kept at most", len(older), ", ".join(sorted(p.name for p in older)))
