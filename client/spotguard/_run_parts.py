"""The parts :class:`spotguard.run.Run` is built from: its state entries, cadence, optimizer hook
and the distributed context it runs in."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping

from spotguard import rng
from spotguard._optim import hookable
from spotguard.cadence import job_nodes

__all__ = ["RngState", "SAVE_EVERY_ENV", "build_state", "cadence_source", "count_steps",
           "default_group", "distributed", "is_spotguard_loader", "loader_entry", "local_rank",
           "make_cadence", "rank", "state_bytes", "unjoined_ranks"]

SAVE_EVERY_ENV = "SPOTGUARD_SAVE_EVERY"
"""Steps between periodic saves of a ``Run`` given neither ``save_every`` nor ``cadence`` (the
default cadence otherwise): ``spotguard drill`` sets it so that its launches commit early. What the
code gives wins."""


class RngState:
    """Adapts :mod:`spotguard.rng` to the state_dict protocol the checkpointer saves."""

    def state_dict(self) -> dict[str, Any]:
        return rng.capture()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng.restore(state)



def count_steps(optimizer: Any, hook: Callable[..., None]) -> bool:
    """Register ``hook`` to run after each real step of ``optimizer`` (unwrapped as
    :func:`spotguard._optim.hookable` says); False when it cannot tell."""
    inner = hookable(optimizer)
    if inner is None:
        return False
    inner.register_step_post_hook(hook)
    return True


def make_cadence(save_every: int | None, cadence: Any) -> Any:
    from spotguard.cadence import Cadence

    if cadence is not None and save_every is not None:
        raise ValueError("give save_every or cadence, not both")
    if cadence is None and save_every is None:
        save_every = env_save_every()
    return cadence or Cadence(every_steps=save_every, nodes=job_nodes())


def env_save_every() -> int | None:
    """``$SPOTGUARD_SAVE_EVERY`` as steps, None when unset; ValueError naming it when invalid."""
    raw = os.environ.get(SAVE_EVERY_ENV, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ValueError(f"${SAVE_EVERY_ENV} must be a number of steps >= 1, got {raw!r}")
    return int(raw)


def cadence_source(save_every: int | None, cadence: Any) -> str:
    """Where a Run's cadence comes from, for its record: ``cadence``, ``save_every`` (the code's),
    ``env`` ($SPOTGUARD_SAVE_EVERY) or ``default`` (Young/Daly at the default MTBF)."""
    if cadence is not None or save_every is not None:
        return "cadence" if cadence is not None else "save_every"
    return "env" if env_save_every() is not None else "default"


def build_state(model: Any, optimizer: Any, scheduler: Any, sampler: Any,
                 extra: Mapping[str, Any] | None) -> dict[str, Any]:
    named = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    state = {name: obj for name, obj in named.items() if obj is not None}
    state.update(extra or {})
    state.setdefault("rng", RngState())
    return state


def loader_entry(loader: Any) -> Any:
    """The checkpoint entry of ``Run(loader=...)``: a spotguard.DataLoader is one; torchdata's
    StatefulDataLoader goes through LoaderState; a plain DataLoader is refused with the fix."""
    from spotguard.data import DataLoader, ignore_stop_signals
    from spotguard.sampler import LoaderState

    if isinstance(loader, DataLoader):
        return loader
    if callable(getattr(loader, "state_dict", None)):
        return LoaderState(ignore_stop_signals(loader))  # its workers outlive a SIGTERM to the group
    raise TypeError(f"Run(loader=) cannot resume a {type(loader).__name__} exactly: build it with "
                    "spotguard.DataLoader (same arguments), or use torchdata's StatefulDataLoader")


def is_spotguard_loader(obj: Any) -> bool:
    data = sys.modules.get("spotguard.data")
    return data is not None and isinstance(obj, data.DataLoader)


def state_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of every tensor reachable from the state's state_dicts (an estimate for a first save)."""
    def walk(obj: Any) -> int:
        if hasattr(obj, "element_size") and hasattr(obj, "nelement"):
            return obj.element_size() * obj.nelement()
        if isinstance(obj, Mapping):
            return sum(walk(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(walk(v) for v in obj)
        return 0

    return sum(walk(o.state_dict() if hasattr(o, "state_dict") else o) for o in state.values())


def distributed() -> Any:
    """``torch.distributed`` when it is initialised, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def default_group(process_group: Any) -> Any:
    """The world group when distributed runs and no group was given (the checkpointer then
    coordinates its commits across ranks), else ``process_group`` as given."""
    dist = distributed()
    if process_group is None and dist is not None and dist.get_world_size() > 1:
        return dist.group.WORLD
    return process_group


def unjoined_ranks() -> str | None:
    """Why this process looks like one of several ranks that never joined a process group: its
    launcher (torchrun, ``accelerate launch``) set ``WORLD_SIZE`` above 1, but torch.distributed is
    not initialised here, so each rank would train alone. None otherwise."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world <= 1 or distributed() is not None:
        return None
    return (f"this process is rank {os.environ.get('RANK', '?')} of {world} (WORLD_SIZE={world}, set by "
            "its launcher), but torch.distributed is not initialised, so each of the ranks trains "
            "alone. Call torch.distributed.init_process_group() before spotguard.Run (as "
            "examples/train_plain.py does), or launch one process without torchrun")


def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``), 0 outside a launcher."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank() -> int:
    dist = distributed()
    return dist.get_rank() if dist is not None else 0
