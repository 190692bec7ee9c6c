"""Where two final checkpoints differ, entry by entry: what ``spotguard drill`` says when the digests
do not match.

A digest says only *that* the drilled run ended elsewhere than the reference. :func:`differences`
reads both final checkpoints (every rank's part, each file checked against its manifest on the
way) and names the first leaves that differ, tensors compared bit for bit.

One difference is not the job's: Lightning's ``ModelCheckpoint`` names a file ``…-v1.ckpt`` when one
of the name it wanted exists already. The drill runs the job twice in the same working directory,
and a launch killed after writing one leaves it for the relaunch, so the drilled run's callback
state can name ``epoch=5-step=96-v1.ckpt`` where the reference's names ``epoch=5-step=96.ckpt``.
Such version suffixes are left out of the comparison (:func:`unversioned`) and reported apart.

Exceptions: :func:`differences` raises ``ValueError`` saying why two checkpoints cannot be compared.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["differences", "unversioned", "describe"]

_VERSION = re.compile(r"-v\d+(?=\.ckpt$)")
_ABSENT = "<absent>"


def unversioned(value: Any, inside: bool = False) -> tuple[Any, bool]:
    """``value`` with the version suffix of every ``.ckpt`` path named in a Lightning
    ``ModelCheckpoint`` state removed (in values and in keys), and whether one was."""
    if isinstance(value, str):
        plain = _VERSION.sub("", value) if inside else value
        return plain, plain != value
    if isinstance(value, dict):
        out, changed = {}, False
        for key, item in value.items():
            here = inside or (isinstance(key, str) and key.startswith("ModelCheckpoint"))
            new_key, key_changed = unversioned(key, here) if isinstance(key, str) else (key, False)
            out[new_key], item_changed = unversioned(item, here)
            changed |= key_changed or item_changed
        return out, changed
    if isinstance(value, (list, tuple)):
        items = [unversioned(item, inside) for item in value]
        return type(value)(item for item, _ in items), any(c for _, c in items)
    return value, False


def _parts(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of the committed checkpoint ``path``, ``{part: {name: value}}``."""
    from spotguard.checkpoint import CheckpointError
    from spotguard.checkpoint.load import read_entries, read_manifest

    try:
        manifest = read_manifest(path)
        parts = sorted({rel.split("/", 1)[0] for rel in manifest["files"] if rel.startswith("rank-")})
        return {part: {key: value for key, (_, value) in
                       read_entries(path, manifest, part, verify=True).items()} for part in parts}
    except (CheckpointError, OSError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def differences(path: Path, base: Path, limit: int = 3) -> tuple[list[tuple[str, Any, Any]], bool]:
    """The first ``limit`` leaves (``part/entry/key…``, mine, theirs) in which the committed
    checkpoint ``path`` differs from ``base``, version suffixes of Lightning's checkpoint files
    left out; and whether such suffixes differed."""
    mine, theirs = _parts(path), _parts(base)
    mine, renamed = unversioned(mine)
    theirs, renamed_too = unversioned(theirs)
    found: list[tuple[str, Any, Any]] = []
    _walk(mine, theirs, "", found, limit)
    return found, renamed or renamed_too


def _walk(a: Any, b: Any, path: str, out: list[tuple[str, Any, Any]], limit: int) -> None:
    import torch

    if len(out) >= limit:
        return
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
            out.append((path, _shown(a), _shown(b)))
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if key not in a or key not in b:
                out.append((f"{path}/{key}", _shown(a.get(key, _ABSENT)), _shown(b.get(key, _ABSENT))))
            else:
                _walk(a[key], b[key], f"{path}/{key}", out, limit)
            if len(out) >= limit:
                return
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}/{i}", out, limit)
    elif type(a) is not type(b) or a != b:
        out.append((path, _shown(a), _shown(b)))


def _bits(t: Any) -> Any:
    """The tensor's bytes (NaN equals NaN, -0.0 differs from 0.0)."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _shown(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    text = value if value == _ABSENT else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def describe(found: list[tuple[str, Any, Any]]) -> str:
    """``found`` in words: where the drilled state differs and what each run holds there."""
    return "; ".join(f"{path.lstrip('/')}: {mine} (drilled) vs {theirs} (reference)"
                     for path, mine, theirs in found)
