"""What a recorded run tells ``spotguard drill`` beyond its checkpoints: the samples each step drew,
and the state the job uses but did not hand to :class:`~spotguard.Run`.

Only for a run that records itself (``$SPOTGUARD_RECORD``), on rank 0, so that a tool can name
the real cause of a resume that is not exact:

* ``data``: after each step, a digest of the sample ids the step drew (``step``, ``ids``), from
  every :class:`~spotguard.ResumableSampler` in the state (a ``spotguard.DataLoader``'s too);
* ``unsaved``: once per object (``what``), an optimizer that stepped without being in the state,
  or a learning-rate scheduler attached to a stepping optimizer while no scheduler is in the state
  (torch marks an optimizer's ``step`` its scheduler wraps). Not for a state that holds a
  framework's own (the Lightning callback's trainer state covers its optimizers and schedulers).

Exceptions: none; nothing here raises into the training loop.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

from spotguard._record import Recorder

__all__ = ["Audit"]


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


class Audit:
    """Follows one run's state for the record; :meth:`close` removes its hook."""

    def __init__(self, record: Recorder, state: Mapping[str, Any]) -> None:
        self.record, self.state, self._hook, self._seen = record, state, None, set()
        self.samplers = _samplers(state) if record.enabled and record.rank == 0 else []
        for sampler in self.samplers:
            sampler.consumed = []
        torch = sys.modules.get("torch")
        framework = any(type(v).__module__.startswith("spotguard.integrations") for v in state.values())
        if record.enabled and record.rank == 0 and torch is not None and not framework:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._hook = register_optimizer_step_post_hook(self._stepped)

    def step(self, done: int) -> None:
        """After step ``done``: record the samples it drew."""
        for i, sampler in enumerate(self.samplers):
            ids = sampler.take_ids_digest()
            if ids is not None:
                self.record.emit("data", step=done, ids=ids if i == 0 else f"{i}:{ids}")

    def _stepped(self, optimizer: Any, *_: Any) -> None:
        if id(optimizer) in self._seen:
            return
        self._seen.add(id(optimizer))
        known = _reachable(self.state)
        if id(optimizer) not in known:
            self.record.emit("unsaved", what=f"optimizer ({type(optimizer).__name__})")
        scheduled = getattr(optimizer.step, "_wrapped_by_lr_sched", False)
        if scheduled and not any(hasattr(v, "get_last_lr") for v in self.state.values()):
            self.record.emit("unsaved", what="LR scheduler")

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for sampler in self.samplers:
            sampler.consumed = None
