"""Distributed agreement: every rank stops, and checkpoints, at the same step.

A notice may reach only one rank (the daemon signals the processes it knows; a scheduler signals
the batch shell; a rank's SUB socket may lag). If that rank stopped alone, its peers would block in
their next collective until the platform kills them, and a checkpoint saved by some ranks only is
useless. So at step boundaries the ranks exchange one small tensor with a single
``all_reduce(MAX)``::

    [stop, checkpoint_now, -seconds_left, -next_interval, save_seconds]

MAX of the flags is "any rank wants it"; MAX of the negated deadline is the MIN deadline (the
earliest notice wins); MAX of ``save_seconds`` is the slowest rank's expected save, so every rank
makes the same emergency-save decision from the same numbers.

**Amortisation.** The exchange costs one collective latency ``c`` (tens of microseconds with gloo on
one host, more across hosts); a step costs ``t``. Checking every ``k`` steps costs ``c / (k t)`` of
the run, so ``k = ceil(c / (overhead t))`` keeps it under ``overhead`` (1 %). But a notice seen by
one rank waits up to ``k t`` seconds before the others learn of it, and that delay comes out of the
grace window (30 s on GCP and Azure Spot, 5 s on RunPod). So ``k t`` is also capped at ``max_lag``
seconds (0.5 s by default): when both cannot hold, the deadline wins over the overhead. (With 2 s,
a 3 s notice to a 2-rank job was acted on 1.1 s late under load, and its emergency save no longer
fitted ``Run``'s 2 s margin; 0.5 s costs at most ``c / 0.5 s`` of the run, 0.2 % at a 1 ms
cross-host collective.) Each rank
proposes its ``k`` from its own measurements and the agreed interval is the MIN of the proposals
(carried in the same tensor), so all ranks keep calling the collective at identical steps, which
is what makes it safe.

**No rank waits forever.** The exchange runs on a private gloo group created with ``timeout``
(``Run(peer_timeout=)``): when a peer's node was killed outright (no notice, no clean exit), the
survivors' exchange fails within that bound (at once when the peer's kernel reset the connections,
after ``timeout`` when the node vanished from the network and nothing answers) and :meth:`agree`
raises :class:`PeerLostError`, which ``Run`` turns into ``EXIT_PEER_LOST`` (77). A private group
also keeps the tiny exchange off an NCCL group (no device sync) and away from the user's own
collectives. A rank that holds a notice also has its forced-exit watchdog armed
(:mod:`spotguard._watchdog`), so a hang ends in ``EXIT_FORCED`` before the notice's deadline.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

from spotguard._gloo_release import released

__all__ = ["Agreement", "Decision", "PeerLostError"]

_NO_DEADLINE = 1e18


@dataclass(frozen=True)
class Decision:
    """What every rank does at this boundary (identical on all ranks after an exchange)."""

    stop: bool = False
    checkpoint: bool = False
    seconds_left: float | None = None
    save_seconds: float | None = None
    durable_seconds: float | None = None
    """The slowest node's time from commit to durable (its daemon's measure; None: unknown): rank 0's
    cadence never plans saves closer than that."""
    marks_equal: tuple[bool, ...] = ()
    """Per mark given to :meth:`Agreement.agree`: whether every rank gave the same value."""


class PeerLostError(RuntimeError):
    """The ranks' exchange did not complete: a peer is gone, or did not arrive within the timeout."""


class Agreement:
    """Exchanges stop/checkpoint flags across ranks every ``interval`` steps (adaptive).

    Created collectively when torch.distributed runs (every rank of the world constructs it, in
    the same order as other groups): it makes a private gloo group over ``process_group``'s ranks
    whose collectives give up after ``timeout`` seconds (None: torch's default, 30 min). Created
    before torch.distributed is initialised (a callback built before its trainer), it exchanges on
    ``process_group`` itself, bounded by that group's own timeout.
    """

    def __init__(self, process_group: Any = None, *, overhead: float = 0.01, max_lag: float = 0.5,
                 max_interval: int = 1000, timeout: float | None = None, share: "Agreement | None" = None) -> None:
        """``share``: exchange on that agreement's group and timeout (a second count of its own, e.g.
        ``run.heartbeat()`` calls; not collective then)."""
        if share is not None:
            process_group, timeout = share._group, share.timeout
        self._group = process_group
        self.timeout = timeout
        self._private = share._private if share is not None else \
            _private_group(process_group, timeout) if self.enabled else None
        self._overhead, self._max_lag, self._max_interval = overhead, max_lag, max_interval
        self.interval = 1
        self._next_check = 0
        self._last: tuple[int, float] | None = None  # (step, monotonic) of the previous exchange
        self._collective_seconds = 0.0

    @property
    def process_group(self) -> Any:
        """The group the flags are agreed in (None: the default group)."""
        return self._group

    @property
    def enabled(self) -> bool:
        """True when torch.distributed runs with more than one rank."""
        try:
            import torch.distributed as dist
        except ImportError:
            return False
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1

    def due(self, step: int) -> bool:
        """True at the boundaries where every rank exchanges flags."""
        return step >= self._next_check

    def agree(self, step: int, local: Decision, marks: Sequence[float] = ()) -> Decision:
        """The agreed decision (call on every rank at the same step; see :meth:`due`). ``marks``
        travel in the same exchange as ``m, -m``: :attr:`Decision.marks_equal` says, per mark,
        whether every rank gave the same value (MAX of both is then ``m, -m``)."""
        if not self.enabled:
            return dataclasses.replace(local, marks_equal=(True,) * len(marks)) if marks else local
        left = _NO_DEADLINE if local.seconds_left is None else local.seconds_left
        save = -1.0 if local.save_seconds is None else local.save_seconds
        durable = -1.0 if local.durable_seconds is None else local.durable_seconds
        values = [float(local.stop), float(local.checkpoint), -left, -self._propose(step), save, durable]
        values += [v for mark in marks for v in (float(mark), -float(mark))]
        started = time.monotonic()
        stop, checkpoint, neg_left, neg_interval, save, durable, *pairs = self._all_reduce_max(values, step)
        self._collective_seconds = time.monotonic() - started
        self.interval = max(1, int(-neg_interval))
        self._next_check = step + self.interval
        return Decision(stop=stop > 0, checkpoint=checkpoint > 0,
                        seconds_left=None if -neg_left >= _NO_DEADLINE / 2 else -neg_left,
                        save_seconds=None if save < 0 else save,
                        durable_seconds=None if durable < 0 else durable,
                        marks_equal=tuple(pairs[i] == -pairs[i + 1] for i in range(0, len(pairs), 2)))

    def barrier(self, step: int) -> None:
        """Wait until every rank got here (bounded like :meth:`agree`; a no-op with one rank)."""
        if self.enabled:
            self._all_reduce_max([0.0], step)

    def _propose(self, step: int) -> int:
        """This rank's wish for the next interval, from its measured step and collective times."""
        now = time.monotonic()
        previous, self._last = self._last, (step, now)
        if previous is None or step <= previous[0]:
            return 1
        step_seconds = (now - previous[1]) / (step - previous[0])
        if step_seconds <= 0:
            return 1
        wanted = math.ceil(self._collective_seconds / (self._overhead * step_seconds))
        bound = math.floor(self._max_lag / step_seconds)
        return max(1, min(wanted, bound, self._max_interval))

    def _all_reduce_max(self, values: list[float], step: int) -> list[float]:
        """``values`` MAX-reduced on the private group (or, before one exists, on the group's own
        device); a failure or timeout becomes :class:`PeerLostError`."""
        import torch
        import torch.distributed as dist

        device = torch.device("cpu") if self._private is not None else collective_device(self._group)
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        started = time.monotonic()
        group = self._private if self._private is not None else self._group
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
            done = work.wait() if self.timeout is None else work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out", "pair closure"
            raise PeerLostError(_lost(step, started, exc)) from exc
        if done is False:
            raise PeerLostError(_lost(step, started, "timed out"))
        del work
        released(tensor)  # gloo's worker let go of it (see spotguard._gloo_release)
        return tensor.tolist()


def collective_device(process_group: Any = None) -> Any:
    """Where a collective's tensors must live on ``process_group``: this rank's GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _lost(step: int, started: float, cause: object) -> str:
    return (f"the ranks' agreement at step {step} failed after {time.monotonic() - started:.1f} s "
            f"({cause}): a peer rank is gone or unreachable (its node killed?)")


def _private_group(process_group: Any, timeout: float | None) -> Any:
    """A gloo group over ``process_group``'s ranks (collective: every rank of the world calls it)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    return dist.new_group(ranks=ranks, backend="gloo", **kwargs)
