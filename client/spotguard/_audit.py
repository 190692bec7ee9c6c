"""What a recorded run tells ``spotguard drill`` beyond its checkpoints: the samples each step drew,
the progress state at each save and load, the final loss, and the state the job uses but did not
hand to :class:`~spotguard.Run`.

Only for a run that records itself (``$SPOTGUARD_RECORD``), on rank 0, so that a tool can name
the real cause of a resume that is not exact, and judge a job that is not reproducible run to run
by what stays exact even then:

* ``data``: after each step, a digest of the sample ids the step drew (``step``, ``ids``), from
  every :class:`~spotguard.ResumableSampler` in the state (a ``spotguard.DataLoader``'s too);
* ``marks``: at each save (``at: "save"``) and right after a resume loaded its checkpoint (``at:
  "load"``), the progress state of ``step``: ``rng`` (a digest per global RNG stream:
  ``python``, ``numpy``, ``torch``, ``cuda``), ``lr`` (every param group's learning rate, optimizer
  by optimizer in the state), ``epoch`` (the first sampler's) and, at a save, ``loss`` (the last
  scalar the job called ``backward()`` on, read only then: no device sync per step);
* ``unsaved``: once per object (``what``), an optimizer that stepped without being in the state
  (with the model parameters it trains), parameters a saved optimizer trains that no model in the
  state holds, or a learning-rate scheduler attached to a stepping optimizer while no scheduler is
  in the state (torch marks an optimizer's ``step`` its scheduler
  wraps). Not for a state that holds a framework's own (the Lightning callback's trainer state
  covers its optimizers and schedulers);
* ``ddp``: once, at the first step, a model in the state that trains through a
  ``DistributedDataParallel`` the state does not hold (``entry``, ``world_size``): its gradient
  bucket layout is then neither recorded nor restored (:mod:`spotguard._ddp`).

With ``SPOTGUARD_RECORD_ELASTIC=1`` (``spotguard drill --resize`` sets it), what a resume on
another number of ranks is judged by, at some cost (a device sync per step, a hash of the model and
optimizer at each save and load):

* ``samples``: after each step, on every rank, the samples the step drew (``drawn``: ``[epoch,
  pass, first, stride, ids]`` chunks, ``ids[j]`` at place ``first + j * stride`` of the epoch's order
  over the whole job, :meth:`~spotguard.ResumableSampler.take_consumed`), the dataset's length
  (``of``) and, on rank 0, the step's ``loss``;
* ``marks`` carry ``state``: a digest per model and optimizer of the state (every tensor of its
  ``state_dict``, DDP's replicated ones whole; a DTensor's shards are left out), and the ``load``
  marks come from every rank.

Exceptions: none; nothing here raises into the training loop.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from typing import Any, Mapping

from spotguard._record import Recorder
from spotguard.sampler import ids_digest

__all__ = ["Audit", "ELASTIC_ENV", "feed_state", "rng_digests", "state_digests"]

ELASTIC_ENV = "SPOTGUARD_RECORD_ELASTIC"

_NAMED = 4
"""Parameter names listed for an unsaved optimizer (then a count of the rest)."""


def _samplers(state: Mapping[str, Any]) -> list[Any]:
    from spotguard.sampler import ResumableSampler

    found = []
    for value in state.values():
        sampler = getattr(value, "resumable", None) if not isinstance(value, ResumableSampler) else value
        if isinstance(sampler, ResumableSampler):
            found.append(sampler)
    return found


def _reachable(state: Mapping[str, Any]) -> set[int]:
    """Ids of the state's objects and the optimizers that optimizer wrappers in it wrap (an
    accelerate ``AcceleratedOptimizer``'s ``optimizer``); a scheduler's optimizer is not saved by
    saving the scheduler, so it is not counted."""
    from torch.optim import Optimizer

    ids = set()
    for value in state.values():
        while value is not None and id(value) not in ids:
            ids.add(id(value))
            value = getattr(value, "optimizer", None) if isinstance(value, Optimizer) else None
    return ids


def _optimizers(state: Mapping[str, Any]) -> list[Any]:
    """The optimizers in the state, and those its LR schedulers drive (a job that left its
    optimizer out of ``Run`` still shows the LR its scheduler sets), each once."""
    found: dict[int, Any] = {}
    for value in state.values():
        for candidate in (value, getattr(value, "optimizer", None)):
            if isinstance(getattr(candidate, "param_groups", None), list):
                found.setdefault(id(candidate), candidate)
                break
    return list(found.values())


def _hash(*parts: Any) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(part.numpy().tobytes() if hasattr(part, "numpy") else repr(part).encode())
    return digest.hexdigest()


def rng_digests(state: Mapping[str, Any] | None = None) -> dict[str, str]:
    """A digest of each global RNG stream :mod:`spotguard.rng` saves (those of loaded libraries):
    of ``state`` (a :func:`spotguard.rng.capture`) when given, else of the live generators."""
    from spotguard import rng

    state = rng.capture() if state is None else state
    return {name: _hash(*value) if isinstance(value, list) else _hash(value)
            for name, value in ((k, state[k]) for k in ("python", "numpy", "torch", "cuda"))
            if value is not None}


def state_digests(state: Mapping[str, Any]) -> dict[str, str]:
    """A digest per model and optimizer of ``state``: every tensor of its ``state_dict`` (dtype,
    shape, bytes) and every other value, keys in order. An entry holding a DTensor (a shard) or
    that cannot be read is left out."""
    out = {}
    for name, value in state.items():
        if not (hasattr(value, "named_parameters") or isinstance(getattr(value, "param_groups", None), list)):
            continue
        digest = hashlib.blake2b(digest_size=8)
        try:
            feed_state(digest, value.state_dict())
        except Exception:  # noqa: BLE001 (a shard, an unreadable tensor: nothing raises into the loop)
            continue
        out[name] = digest.hexdigest()
    return out


def feed_state(digest: Any, value: Any) -> None:
    """Feed ``value`` (a ``state_dict``: tensors, mappings, sequences, plain values) into the hash
    ``digest``: each tensor's dtype, shape and bytes, keys in order. A DTensor (a shard) raises
    TypeError: its bytes are not the state's."""
    if hasattr(value, "full_tensor"):
        raise TypeError("a DTensor shard")
    if hasattr(value, "detach") and hasattr(value, "dtype"):
        tensor = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{tensor.dtype}{tuple(value.shape)}".encode())
        digest.update(tensor.view(sys.modules["torch"].uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(f"K{key!r}".encode())
            feed_state(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            feed_state(digest, item)
    else:
        digest.update(f"V{value!r}".encode())


class _LossTap:
    """Keeps the last scalar ``Tensor.backward()`` was called on (detached; read only at a save).
    Installed while at least one Audit records, torch's own method put back after the last."""

    users = 0
    original: Any = None
    last: Any = None

    @classmethod
    def install(cls, torch: Any) -> None:
        cls.users += 1
        if cls.users > 1:
            return
        cls.original = original = torch.Tensor.backward

        @functools.wraps(original)
        def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.numel() == 1 and self.is_floating_point():
                _LossTap.last = self.detach()
            return original(self, *args, **kwargs)

        torch.Tensor.backward = backward

    @classmethod
    def remove(cls) -> None:
        cls.users -= 1
        if cls.users == 0:
            sys.modules["torch"].Tensor.backward = cls.original
            cls.original = cls.last = None

    @classmethod
    def value(cls) -> float | None:
        try:
            return None if cls.last is None else float(cls.last)
        except (RuntimeError, ValueError):  # a meta or otherwise unreadable tensor
            return None


class Audit:
    """Follows one run's state for the record; :meth:`close` removes its hooks."""

    def __init__(self, record: Recorder, state: Mapping[str, Any]) -> None:
        self.record, self.state, self._hook, self._seen = record, state, None, set()
        self.on = record.enabled and record.rank == 0
        self.elastic = record.enabled and os.environ.get(ELASTIC_ENV) == "1"
        """Every rank records its samples, rank 0 its loss per step, the marks a state digest."""
        self.samplers = _samplers(state) if self.on or self.elastic else []
        for sampler in self.samplers:
            sampler.consumed = []
        self._first = True
        torch = sys.modules.get("torch")
        self._tapped = self.on and torch is not None
        if self._tapped:
            _LossTap.install(torch)
        framework = any(type(v).__module__.startswith("spotguard.integrations") for v in state.values())
        if self.on and torch is not None and not framework:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._hook = register_optimizer_step_post_hook(self._stepped)

    def step(self, done: int) -> None:
        """After step ``done``: record the samples it drew (and, the first time, what a resume
        loaded and a DDP the state does not hold: a run's first boundary past step 0 follows
        its load)."""
        if self._first and (self.on or self.elastic):
            self._first = False
            if self.on:
                self._find_ddp()
            if done > 0:
                self._marks(done, "load")
        for i, sampler in enumerate(self.samplers):
            taken = sampler.take_consumed()
            ids = ids_digest(taken) if self.on else None
            if ids is not None:
                self.record.emit("data", step=done, ids=ids if i == 0 else f"{i}:{ids}")
            if self.elastic and i == 0 and done > 0:
                self.record.emit("samples", step=done, drawn=[list(chunk) for chunk in taken],
                                 of=sampler.num_items, loss=_LossTap.value() if self._tapped else None)
        if self.elastic and not self.samplers and self._tapped and done > 0:
            self.record.emit("samples", step=done, loss=_LossTap.value())

    def saving(self, done: int, rng_state: Mapping[str, Any] | None = None) -> None:
        """The run saves step ``done`` now: record its progress state (``rng_state``: the RNG
        states saved, when they are not the live ones, as in a save beside an evaluation)."""
        if self.on:
            self._marks(done, "save", rng_state, loss=_LossTap.value())

    def _marks(self, step: int, at: str, rng_state: Mapping[str, Any] | None = None, **extra: Any) -> None:
        lrs = [float(group["lr"]) for optimizer in _optimizers(self.state)
               for group in optimizer.param_groups if "lr" in group]
        epoch = self.samplers[0].epoch if self.samplers else None
        if self.elastic:
            extra["state"] = state_digests(self.state)
        self.record.emit("marks", step=step, at=at, rng=rng_digests(rng_state), lr=lrs, epoch=epoch, **extra)

    def _find_ddp(self) -> None:
        """Record a model of the state trained through a DDP the state does not hold (found among
        the calling frames' variables, as :func:`spotguard._ddp.enclosing` finds one)."""
        from spotguard import _ddp

        if any(_ddp.is_ddp(value) for value in self.state.values()):
            return
        for name, value in self.state.items():
            ddp = _ddp.enclosing(value, depth=16) if hasattr(value, "parameters") else None
            if ddp is not None:
                import torch.distributed as dist

                self.record.emit("ddp", entry=name, world_size=dist.get_world_size(ddp.process_group))
                return

    def _stepped(self, optimizer: Any, *_: Any) -> None:
        if id(optimizer) in self._seen:
            return
        self._seen.add(id(optimizer))
        known = _reachable(self.state)
        if id(optimizer) not in known:
            self.record.emit("unsaved", what=f"optimizer ({type(optimizer).__name__}){self._trains(optimizer)}")
        else:
            self._covered(optimizer)
        scheduled = getattr(optimizer.step, "_wrapped_by_lr_sched", False)
        if scheduled and not any(hasattr(v, "get_last_lr") for v in self.state.values()):
            self.record.emit("unsaved", what="LR scheduler")

    def _covered(self, optimizer: Any) -> None:
        """Record the parameters a saved optimizer trains that no model in the state holds (their
        weights would start over on resume), when the state holds a model at all."""
        models = [value for value in self.state.values() if hasattr(value, "named_parameters")]
        if not models:
            return
        held = {id(p) for model in models for p in model.parameters()}
        loose = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in held]
        if loose:
            shapes = ", ".join(str(list(p.shape)) for p in loose[:_NAMED])
            more = f" and {len(loose) - _NAMED} more" if len(loose) > _NAMED else ""
            self.record.emit("unsaved", what=f"{len(loose)} parameter tensor(s) the optimizer "
                             f"({type(optimizer).__name__}) trains but no model in Run holds "
                             f"(shapes {shapes}{more})")

    def _trains(self, optimizer: Any) -> str:
        """``" training model: head.weight, head.bias"``: the state's parameters the optimizer
        trains (none of the state's optimizers covers them)."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = {entry: [name for name, p in value.named_parameters() if id(p) in params]
                 for entry, value in self.state.items() if hasattr(value, "named_parameters")}
        parts = []
        for entry, names in named.items():
            if names:
                more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
                parts.append(f"{entry}: {', '.join(names[:_NAMED])}{more}")
        return " training " + "; ".join(parts) if parts else ""

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._tapped:
            self._tapped = False
            _LossTap.remove()
        for sampler in self.samplers:
            sampler.consumed = None
