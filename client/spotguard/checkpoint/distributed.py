"""Multi-rank saves over ``torch.distributed`` without ever unpickling from a socket.

Every rank writes its own ``rank-<r>/`` part into one tmp directory that rank 0 creates; the ranks
agree on its name and on progress with ``all_reduce`` of small int64 tensors only (never
``gather_object``/``broadcast_object_list``, which unpickle what arrives). Steps of one save::

    rank 0 mkdir tmp ─ all_reduce(pid, fail)  -> everyone knows .tmp-step-N-<pid0>
    each rank: rank-<r>/ data (+ dcp/) + part.json ─ all_reduce(fail)  (barrier 1: parts durable)
    rank 0: merge parts into manifest.json, rename, latest ─ all_reduce(ok) (barrier 2, timeout)

With node-local roots (no directory every rank sees; found by :func:`.nodes.discover`) each node's
leader (its lowest rank) makes the tmp directory on its own disk, the ranks exchange their parts'
digests as int64 words with the barrier-1 ``all_reduce``, and each leader commits a *node-local*
manifest of its own ranks' parts, with a ``node`` section (index, node count, leader, ranks, every
rank's digest) from which the store assembles the global manifest once every node's part is durable
(see :mod:`spotguard.storage.durable`). A leader's part carries the replicated state too.

A rank's DTensor shards go to ``rank-<r>/dcp/`` through DCP with ``no_dist`` (see :mod:`.sharded`):
DCP's own planning collectives would ``gather_object``, so every rank writes its own DCP metadata
and the files are hashed into ``part.json`` like the rest.

Collectives run on a private gloo group created at construction, so the background thread never
interleaves with the training loop's own collectives on the user's group.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotguard._forkgate import torch_work
from spotguard._gloo_release import released
from spotguard.checkpoint import _fs, commit
from spotguard.checkpoint._workers import Throttle
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.layout import CommitInfo, combine_digests, step_name, tmp_name
from spotguard.checkpoint.load import check
from spotguard.checkpoint.nodes import Topology, digests_to_ints, discover, ints_to_digest
from spotguard.checkpoint.staging import Snapshot

__all__ = ["Coordinator"]

PART = "part.json"
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Coordinator:
    """The ranks' side of a save; created collectively (every rank of the world calls it)."""

    def __init__(self, process_group: Any, timeout: float) -> None:
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.timeout = timedelta(seconds=timeout)
        ranks = dist.get_process_group_ranks(process_group)
        self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=self.timeout)
        self.exchanging = False
        """True while this rank waits in an exchange with the others (read by other threads)."""
        self.topology: Topology | None = None
        """Who shares this rank's checkpoint root, once :meth:`discover` ran (None: rank 0 commits)."""

    def discover(self, root: Path) -> Topology:
        """Collective: find which ranks share ``root`` (see :mod:`.nodes`)."""
        self.topology = discover(self, root)
        return self.topology

    @property
    def leader(self) -> int:
        """The rank that creates and commits this rank's checkpoint directory."""
        return self.topology.leader if self.topology else 0

    @property
    def node_local(self) -> bool:
        return self.topology is not None and not self.topology.shared

    def all_reduce(self, values: list[int], op: str = "sum") -> list[int]:
        """Reduce a few ints across ranks, waiting at most the timeout."""
        started = time.monotonic()
        self.exchanging = True
        try:
            with torch_work():  # the persist thread calls this: no fork cuts through the launch
                t = torch.tensor(values, dtype=torch.int64)
                work = dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True)
            done = work.wait(self.timeout)  # not a piece: a fork need not wait for the other ranks
        except RuntimeError as exc:  # gloo raises on timeout or a vanished peer
            raise CheckpointError(self._failed(time.monotonic() - started, exc)) from exc
        finally:
            self.exchanging = False
        if done is False:
            raise CheckpointError(self._failed(time.monotonic() - started, None))
        del work
        released(t)  # gloo's worker let go of it (see spotguard._gloo_release)
        with torch_work():
            return t.tolist()

    def _failed(self, waited: float, exc: BaseException | None) -> str:
        """Why the ranks' exchange failed, with the time it really waited: a peer that crashed
        fails it at once (its connection closed), a peer that hangs or vanished only at the timeout."""
        limit = self.timeout.total_seconds()
        cause = " ".join(str(exc).split())[:300] if exc is not None else "no answer"
        if exc is None or waited >= 0.9 * limit:
            return (f"checkpoint ranks did not agree within {limit:.0f} s ({cause}): a peer rank is "
                    "stuck or unreachable")
        return (f"checkpoint ranks did not agree: the exchange failed after {waited:.1f} s ({cause}): "
                "a peer rank is gone (it crashed or its node was killed)")

    def agree(self, value: int, op: str) -> int:
        return self.all_reduce([value], op)[0]

    def persist(self, root: Path, snap: Snapshot, meta: dict[str, Any], *, large_bytes: int,
                nice: int | None, throttle: Throttle | None = None, writer: Any = None) -> CommitInfo:
        """Write this rank's part and (rank 0) commit; every rank returns the same CommitInfo."""
        tmp = self._make_tmp(root, meta["step"])
        digest: list[str] = []
        failure = self._guard(lambda: digest.append(self._write_part(tmp, snap, large_bytes, nice, throttle,
                                                                     writer)))
        if not self.node_local:
            if self.agree(int(failure is not None), "sum"):
                return self._abort(root, tmp, snap, failure, "writing its part")
            commit_ = lambda: self._commit(root, tmp, meta)  # noqa: E731
        else:  # the digests travel with barrier 1: each leader commits its own node's parts
            words = digests_to_ints(self.rank, self.world_size, digest[0] if digest else "0" * 64)
            summed = self.all_reduce([int(failure is not None)] + words)
            if summed[0]:
                return self._abort(root, tmp, snap, failure, "writing its part")
            digests = [ints_to_digest(summed[1:], r) for r in range(self.world_size)]
            commit_ = lambda: self._commit_node(root, tmp, meta, digests)  # noqa: E731
        leads = self.rank == self.leader
        committed = self._guard(commit_) if leads else None
        if self.agree(int(leads and committed is not None), "sum"):
            return self._abort(root, tmp, snap, committed if leads else None, "committing")
        return check(root / step_name(meta["step"]))

    def _make_tmp(self, root: Path, step: int) -> Path:
        """The leader of each root creates its tmp directory; every rank learns its leader's pid."""
        leads, mine = self.rank == self.leader, root / tmp_name(step, os.getpid())
        failed = int(leads and self._guard(lambda: _fs.mkdir_private(mine)) is not None)
        slots = [0] * self.world_size + [failed]
        slots[self.rank] = os.getpid() if leads else 0
        try:
            values = self.all_reduce(slots)
        except CheckpointError:
            if leads:
                _fs.remove_tree(mine)
            raise
        if values[-1]:
            if leads:
                _fs.remove_tree(mine)
            raise CheckpointError(f"{values[-1]} leader rank(s) could not create a checkpoint directory "
                                  f"under {root}")
        return root / tmp_name(step, values[self.leader])

    @staticmethod
    def _guard(fn: Any) -> BaseException | None:
        try:
            fn()
        except Exception as exc:  # reported to the other ranks, then raised here
            return exc
        return None

    def _write_part(self, tmp: Path, snap: Snapshot, large_bytes: int, nice: int | None,
                    throttle: Throttle | None, writer: Any) -> str:
        part = tmp / f"rank-{self.rank}"
        files, digest = commit.write_part(part, snap, large_bytes=large_bytes, nice=nice, throttle=throttle,
                                          writer=writer)
        _fs.write_file(part / PART, json.dumps({"rank": self.rank, "files": files, "digest": digest}).encode())
        _fs.fsync_dir(part)
        return digest

    @staticmethod
    def _merge(tmp: Path, ranks: list[int]) -> tuple[dict[str, dict], list[str]]:
        """The manifest's files of the parts of ``ranks``, and their digests."""
        files: dict[str, dict] = {}
        digests = []
        for r in ranks:
            raw = (tmp / f"rank-{r}" / PART).read_bytes()
            part = json.loads(raw)
            files.update({f"rank-{r}/{k}": v for k, v in part["files"].items()})
            files[f"rank-{r}/{PART}"] = {"size": len(raw), "sha256": _fs.sha256_of(raw)}
            digests.append(part["digest"])
        return files, digests

    def _commit(self, root: Path, tmp: Path, meta: dict[str, Any]) -> None:
        files, digests = self._merge(tmp, list(range(self.world_size)))
        commit.write_manifest(tmp, {**meta, "digest": combine_digests(digests)}, files)
        commit.publish(root, tmp, meta["step"])

    def _commit_node(self, root: Path, tmp: Path, meta: dict[str, Any], digests: list[str]) -> None:
        """Commit this node's parts locally: a node-local manifest with its ``node`` section."""
        topo = self.topology
        assert topo is not None
        files, own = self._merge(tmp, topo.ranks)
        if own != [digests[r] for r in topo.ranks]:
            raise CheckpointError("a part's digest on disk differs from the one its rank reported")
        node = {"index": topo.node, "nodes": len(topo.nodes), "leader": topo.leader, "ranks": topo.ranks,
                "digests": digests, "layout": topo.layout}
        commit.write_manifest(tmp, {**meta, "digest": combine_digests(digests), "node": node}, files)
        commit.publish(root, tmp, meta["step"])

    def _abort(self, root: Path, tmp: Path, snap: Snapshot, exc: BaseException | None, what: str) -> Any:
        if self.rank == self.leader:
            _fs.remove_tree(tmp)
        if exc is None:
            raise CheckpointError(f"another rank failed {what} the checkpoint; nothing was committed")
        raise commit.translate_error(exc, root, snap.nbytes) from exc
