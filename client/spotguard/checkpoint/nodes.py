"""Which ranks share a checkpoint root: one shared directory, or a node-local root per node.

Found once, collectively, when a multi-rank :class:`~.manager.Checkpointer` starts, from what the
ranks can see rather than from a setting: every rank creates ``.probe-<token>-<rank>`` in its root
(the token is rank 0's random number, exchanged with ``all_reduce``; the root is private), then
lists which ranks' probes it sees. Ranks that see each other's probes share a root; the lowest of
them is its *leader*. One root for every rank is the shared-directory mode (rank 0 commits the
whole); several are the node-local mode: each leader commits a node-local manifest of its own
ranks' parts, and carries the replicated state in its own part (see :mod:`.distributed`).

Only ints cross the wire (``all_reduce`` of int64 tensors), never a pickle.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.checkpoint import _fs

__all__ = ["Topology", "discover", "digests_to_ints", "ints_to_digest"]

_WORDS = 4  # a sha256 as four 64-bit words


@dataclass(frozen=True)
class Topology:
    """Who shares this rank's root: ``leaders[r]`` is the leader (lowest rank) of rank r's root."""

    rank: int
    leaders: tuple[int, ...]

    @property
    def shared(self) -> bool:
        """One root for every rank (a shared directory)."""
        return all(leader == 0 for leader in self.leaders)

    @property
    def leader(self) -> int:
        return self.leaders[self.rank]

    @property
    def nodes(self) -> list[int]:
        """The leaders, in rank order: node k is the root led by ``nodes[k]``."""
        return sorted(set(self.leaders))

    @property
    def node(self) -> int:
        return self.nodes.index(self.leader)

    @property
    def layout(self) -> list[list[int]]:
        """Which node holds each rank, as runs ``[[node, count], ...]`` over the ranks in order
        (contiguous ranks per node: one run a node); the store's global manifest carries node 0's."""
        runs: list[list[int]] = []
        position = {leader: k for k, leader in enumerate(self.nodes)}
        for leader in self.leaders:
            index = position[leader]
            if runs and runs[-1][0] == index:
                runs[-1][1] += 1
            else:
                runs.append([index, 1])
        return runs

    @property
    def ranks(self) -> list[int]:
        """The ranks that share this rank's root."""
        return [r for r, leader in enumerate(self.leaders) if leader == self.leader]


def discover(coord: Any, root: Path) -> Topology:
    """Collective: probe which ranks share ``root`` (created here, private, by every rank)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = coord.agree(secrets.randbits(62) if coord.rank == 0 else 0, "sum")
    own = root / f".probe-{token}-{coord.rank}"
    fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    _fs.fsync_dir(root)
    try:
        coord.agree(0, "sum")  # every probe exists before anyone looks
        seen = [r for r in range(coord.world_size) if (root / f".probe-{token}-{r}").exists()]
        slots = [0] * coord.world_size
        slots[coord.rank] = min(seen) + 1
        leaders = coord.all_reduce(slots, "sum")
    finally:
        own.unlink(missing_ok=True)
    return Topology(coord.rank, tuple(leader - 1 for leader in leaders))


def digests_to_ints(rank: int, world_size: int, digest: str) -> list[int]:
    """This rank's sha256 hex digest in its four slots of a ``world_size * 4`` vector of int64
    (a sum over ranks then carries every rank's digest: one nonzero addend per slot)."""
    slots = [0] * (world_size * _WORDS)
    raw = bytes.fromhex(digest)
    for i in range(_WORDS):
        slots[rank * _WORDS + i] = int.from_bytes(raw[8 * i : 8 * i + 8], "big", signed=True)
    return slots


def ints_to_digest(values: list[int], rank: int) -> str:
    """Rank ``rank``'s digest back from a summed :func:`digests_to_ints` vector."""
    words = values[rank * _WORDS : rank * _WORDS + _WORDS]
    return b"".join(w.to_bytes(8, "big", signed=True) for w in words).hex()
