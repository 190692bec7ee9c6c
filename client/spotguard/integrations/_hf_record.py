"""The run record (:mod:`spotguard._record`) of a Hugging Face ``Trainer`` job, so that
``spotguard drill`` and ``spotguard run`` judge it as they judge a ``Run`` job.

The :class:`~spotguard.integrations.huggingface.SpotguardTrainerCallback` calls :class:`TrainerRecord`
at its events: ``start`` at ``on_train_begin`` (``root`` is ``output_dir``, ``resumed_from`` the
global step the Trainer loaded), ``progress`` at every step end, ``commit`` at each ``on_save``
(``path`` the ``checkpoint-<N>`` directory, ``blocking_s`` the save's measured time; ``kind``
``emergency`` for a stop's save), and ``finish`` at a normal end (a stop's ``stop`` event, with the
notice timeline's fields, is :func:`spotguard._run_stop.report_stop`'s, as ``Run``'s); rank 0 alone
records progress, commits and the finish. Each save's ``marks`` (RNG stream digests, LRs, epoch) let the drill check that they go
on as in an uninterrupted run; none is recorded at a load (the Trainer restores its RNG streams
later, inside its epoch loop). A commit's and the finish's ``digest`` (:func:`state_digest`) covers what a resume
restores: the weights, the optimizer's and the LR scheduler's states, the global step and epoch
and every global RNG stream, computed from the objects in memory (the Trainer's files hold times
and control flags that differ between two equal runs). Nothing here raises into training.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

from spotguard._audit import feed_state, rng_digests
from spotguard._record import Recorder

__all__ = ["TrainerRecord", "state_digest"]

ENTRIES = ["model", "optimizer", "rng", "scheduler", "trainer_state"]
"""What a Trainer checkpoint holds, in the start event's ``entries``."""


def state_digest(state: Any, kwargs: Mapping[str, Any]) -> str:
    """sha256 of what a resume of this Trainer restores (see the module docstring)."""
    digest = hashlib.sha256()
    for name in ("model", "optimizer", "lr_scheduler"):
        obj = kwargs.get(name)
        if obj is not None and hasattr(obj, "state_dict"):
            digest.update(name.encode())
            feed_state(digest, obj.state_dict())
    feed_state(digest, [state.global_step, state.epoch, rng_digests()])
    return digest.hexdigest()


class TrainerRecord:
    """The record of one ``trainer.train()`` call (see the module docstring)."""

    def __init__(self, record: Recorder) -> None:
        self.record = record

    @property
    def zero(self) -> bool:
        return self.record.enabled and self.record.rank == 0

    def begin(self, args: Any, state: Any) -> None:
        self.record.start(root=os.path.abspath(args.output_dir), world_size=args.world_size,
                          resumed_from=state.global_step or None, skipped=[], total=state.max_steps,
                          entries=ENTRIES, cadence="save_steps")

    def saved(self, state: Any, path: Any, seconds: float | None, kwargs: Mapping[str, Any],
              kind: str = "periodic") -> None:
        if self.zero:
            optimizer = kwargs.get("optimizer")
            self.record.emit("marks", step=state.global_step, at="save", rng=rng_digests(),
                             lr=[float(g["lr"]) for g in getattr(optimizer, "param_groups", None) or []],
                             epoch=None if state.epoch is None else int(state.epoch))
            self.record.emit("commit", step=state.global_step, kind=kind, path=os.path.abspath(path),
                             digest=state_digest(state, kwargs), blocking_s=seconds, persist_s=0.0)

    def end(self, state: Any, kwargs: Mapping[str, Any]) -> None:
        if self.zero:
            self.record.emit("finish", step=state.global_step, digest=state_digest(state, kwargs))
