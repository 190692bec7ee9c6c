"""The optimizer whose step hooks really run, under wrappers that do not run them.

Accelerate's ``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` without calling its
``__init__``: registering a step hook on it fails (it has no hook table), and its ``step`` skips
the inner step while gradients accumulate. Hooks go on the optimizer it wraps, so they see exactly
the steps that changed the model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["hookable"]


def hookable(optimizer: Any) -> Any:
    """``optimizer``, or the one it wraps (``.optimizer``, repeatedly), that runs torch's step
    hooks; None when there is none."""
    while optimizer is not None and not hasattr(optimizer, "_optimizer_step_post_hooks"):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer if optimizer is not None and hasattr(optimizer, "register_step_post_hook") else None
