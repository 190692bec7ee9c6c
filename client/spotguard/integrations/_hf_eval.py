"""A notice during a Hugging Face ``Trainer``'s evaluation inside ``train()``: stop there, not after it.

The Trainer evaluates after a step's end (``on_step_end``, or ``on_epoch_end`` for an epoch
strategy) and before that step's scheduled save; an evaluation can take minutes, longer than a
GCP (30 s) or RunPod (5 s) notice. :class:`EvalPause` keeps, when an evaluation is due, the step
it follows and the global RNG states (:func:`spotguard.rng.capture`); the model, optimizer,
scheduler and data position (a function of the global step in the Trainer) do not change during an
evaluation. At each ``on_prediction_step`` the callback asks :meth:`EvalPause.stop_now`, and on a
stopping notice (the far-deadline rule as at a step end) it puts those RNG states back, has the
Trainer write ``checkpoint-<step>`` at once (its own ``_save_checkpoint``, then ``on_save`` for every
callback, as the Trainer does after a save) when the save fits before the deadline, and ends
``train()`` with ``SystemExit(75)``: the script's code after ``train()`` does not run (its
``finally`` blocks and ``atexit`` handlers do, :mod:`spotguard._exit`), nor do the other callbacks'
``on_train_end``. The Trainer is found in the calling frames (its evaluation loop's ``self``); none
found (a custom loop) leaves the notice to the next step end. A failed save (the Trainer's
``_save_checkpoint`` raising) is logged and the stop reported ``failed``: the last checkpoint stands.

At the evaluation's end (``on_evaluate``) the RNG states of its start are put back, so an
evaluation never changes training and a stop during one resumes bit-identically (tested).
With several ranks the callback's exchange also runs at the prediction steps (every N of them, the
marks of ``Run(agree_at_heartbeat=True)``: the prediction step's number and the step the evaluation
follows), so every rank saves the same step there; ``agree_in_evaluation=False`` leaves a notice
during an evaluation to the next step end.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from spotguard import rng

__all__ = ["EvalPause", "calling_trainer"]

log = logging.getLogger("spotguard.integrations.huggingface")

_FRAMES = 16
"""How many calling frames :func:`calling_trainer` looks through (the evaluation loop is 3-4 up)."""


def calling_trainer() -> Any:
    """The ``transformers.Trainer`` among the calling frames' ``self``; None when there is none."""
    from transformers import Trainer

    frame = sys._getframe(1)
    try:
        for _ in range(_FRAMES):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


class EvalPause:
    """The state an evaluation inside ``train()`` must not change (see the module docstring)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self._rng: dict[str, Any] | None = None

    def begin(self, step: int) -> None:
        """An evaluation is due after ``step``: keep the RNG states of now."""
        self.step, self._rng = step, rng.capture()

    def put_back(self) -> None:
        """Put back the RNG states kept (the evaluation's end, or a stop during it)."""
        if self._rng is not None:
            rng.restore(self._rng)

    def clear(self) -> None:
        self.step = self._rng = None

    @property
    def active(self) -> bool:
        return self.step is not None
