"""How far apart the final parameters of two runs of a job are, read from their checkpoints.

For a job that is not reproducible run to run, ``spotguard drill`` compares the drilled final state
with the reference's by distance rather than digest, against the distance between two
uninterrupted references: :func:`distance` is ``||a - b|| / ||b||`` over every floating-point
tensor of the ``model`` entry (of every entry but ``rng`` when there is none), read from the newest
committed checkpoint of each root, each file checked against the manifest on the way.
:func:`loss_distance` is ``|a - b| / |b|`` of two runs' last losses (:func:`final_loss`, from the
run record's ``marks`` at the save of the final step).

Exceptions: :func:`distance` raises ``ValueError`` saying why two checkpoints cannot be compared.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

__all__ = ["distance", "final_parameters", "entry_of", "final_loss", "loss_distance"]


def _tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{prefix}/{i}")


def final_parameters(root: Path) -> dict[str, Any]:
    """Name -> tensor of the newest committed checkpoint under ``root`` (rank 0's part)."""
    from spotguard.checkpoint.layout import read_latest
    from spotguard.checkpoint.load import read_entries, read_manifest

    name = read_latest(root)
    if name is None:
        raise ValueError(f"{root} holds no committed checkpoint")
    path = root / name
    manifest = read_manifest(path)
    entries = read_entries(path, manifest, "rank-0", verify=True)
    chosen = {"model": entries["model"]} if "model" in entries else {
        key: value for key, value in entries.items() if key != "rng"}
    return dict(_tensors({key: value for key, (_, value) in chosen.items()}))


def entry_of(path: Path, name: str) -> Any:
    """The value of the state entry ``name`` in the committed checkpoint ``path`` (rank 0's part),
    None when it has none or cannot be read (such as DDP's ``ddp_layout``)."""
    from spotguard.checkpoint import CheckpointError
    from spotguard.checkpoint.load import read_entries, read_manifest

    try:
        found = read_entries(path, read_manifest(path), "rank-0", verify=True).get(name)
    except (CheckpointError, OSError, ValueError):
        return None
    return None if found is None else found[1]


def final_loss(events: list[dict[str, Any]]) -> float | None:
    """The loss of a finished run's last step: the ``loss`` of rank 0's ``marks`` at the save of its
    final step (:mod:`spotguard._audit`), None when the record has none."""
    finish = next((e for e in events if e["event"] == "finish" and e.get("rank", 0) == 0), None)
    losses = [e.get("loss") for e in events if e["event"] == "marks" and e.get("rank", 0) == 0
              and e.get("at") == "save" and finish is not None and e["step"] == finish["step"]]
    return next((loss for loss in reversed(losses) if loss is not None), None)


def loss_distance(mine: float | None, base: float | None) -> float | None:
    """``|a - b| / |b|`` of two final losses, None without both."""
    if mine is None or base is None or not math.isfinite(mine) or not math.isfinite(base):
        return None
    return abs(mine - base) / (abs(base) or 1.0)


def distance(root: Path, base: Path) -> float:
    """``||a - b|| / ||b||`` between the final parameters under ``root`` (a) and ``base`` (b)."""
    mine, theirs = final_parameters(root), final_parameters(base)
    if mine.keys() != theirs.keys() or any(mine[k].shape != theirs[k].shape for k in mine):
        raise ValueError(f"{root} and {base} hold different parameters")
    diff = sum(float((mine[k].double() - theirs[k].double()).pow(2).sum()) for k in mine)
    norm = sum(float(theirs[k].double().pow(2).sum()) for k in theirs)
    return math.sqrt(diff) / (math.sqrt(norm) or 1.0)
