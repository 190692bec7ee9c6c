"""Capture and restore every random number generator a training step draws from.

A resumed run only replays the interrupted one exactly if dropout masks, augmentations and shuffles
draw the same numbers, so a checkpoint must carry the state of each global generator:

* Python's :mod:`random`;
* NumPy's legacy global generator (``np.random.get_state``);
* torch's CPU generator;
* torch's CUDA generator on every visible device.

The captured dict holds only plain values (``int``, ``float``, ``str``, ``bool``, ``None``, lists
and dicts of those) and torch ``uint8`` tensors, so it survives
``torch.load(..., weights_only=True)`` and, minus the tensors, JSON. Nothing here pickles.

A library is captured only if the process has already imported it: one that was never imported has
drawn nothing, and importing torch just to read its untouched seed would cost a second of start-up
in a NumPy-only job. This keeps the module importable, and usable, without torch or NumPy.

CUDA: ``state["cuda"]`` is ``None`` when no CUDA state was captured (torch not loaded, or CUDA not
available), else one tensor per device. Restoring onto a machine with fewer devices (or none)
restores what it can and emits :class:`RngRestoreWarning`; extra devices keep their own state.

Exceptions::

    RngStateError (ValueError)   the dict is not a state this module wrote
    RngRestoreWarning (UserWarning)   a part of the state could not be restored on this machine
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import warnings
from typing import Any

__all__ = ["capture", "restore", "derive", "RngStateError", "RngRestoreWarning", "FORMAT"]

FORMAT = 1
"""Version of the dict layout; :func:`restore` refuses any other."""


class RngStateError(ValueError):
    """The state is malformed or from an unknown format version."""


class RngRestoreWarning(UserWarning):
    """Part of a captured state could not be restored here (no torch, no NumPy, fewer GPUs)."""


def capture() -> dict[str, Any]:
    """Return the current state of every loaded generator; drawing nothing, changing nothing."""
    torch = sys.modules.get("torch")
    cuda = _capture_cuda(torch) if torch is not None else None
    return {
        "format": FORMAT,
        "python": _capture_python(),
        "numpy": _capture_numpy(),
        "torch": torch.get_rng_state() if torch is not None else None,
        "cuda": cuda,
        "cuda_devices": len(cuda) if cuda is not None else 0,
    }


def restore(state: dict[str, Any]) -> None:
    """Put every generator back to ``state`` (from :func:`capture`, possibly via a checkpoint).

    Everything is validated first, so a malformed ``state`` raises :class:`RngStateError` and
    changes nothing.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise RngStateError(f"not an RNG state of format {FORMAT}: {_describe(state)}")
    python = _python_tuple(state.get("python"))
    numpy_state = _numpy_tuple(state["numpy"]) if state.get("numpy") is not None else None
    torch_states = _torch_states(state.get("torch"), state.get("cuda") or [])
    random.setstate(python)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)
    if torch_states is not None:
        _restore_torch(*torch_states)


def derive(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """A new state, in :func:`capture`'s layout, for ``rank`` of a job resumed on ``world_size``
    ranks from ``state`` (a rank's saved state): each generator ``state`` holds is seeded afresh
    from a digest of ``state``, the rank and the world size. Deterministic (the same checkpoint
    resumed on the same world derives the same streams), distinct per rank; an elastic resume
    uses it, since the saved per-rank streams no longer match the ranks (see
    :class:`~spotguard.checkpoint.Checkpointer`)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise RngStateError(f"not an RNG state of format {FORMAT}: {_describe(state)}")
    h = hashlib.blake2b(json.dumps([state.get("python"), state.get("numpy"), rank, world_size]).encode(),
                        digest_size=8)
    cpu = state.get("torch")
    if cpu is not None and hasattr(cpu, "numpy"):
        h.update(cpu.numpy().tobytes())
    seed = int.from_bytes(h.digest(), "little") >> 1  # torch seeds are int64
    out = dict(state, python=_capture_python(random.Random(seed)))
    if state.get("numpy") is not None:
        import numpy as np

        out["numpy"] = _capture_numpy(np.random.RandomState(seed % 2**32))
    if cpu is not None:
        import torch

        out["torch"] = torch.Generator().manual_seed(seed).get_state()
        # a CUDA (Philox) state is its seed and offset, two 64-bit ints
        out["cuda"] = [torch.tensor([seed + 1 + i, 0], dtype=torch.int64).view(torch.uint8)
                       for i in range(len(state.get("cuda") or []))] or state.get("cuda")
    return out


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"dict with keys {sorted(map(str, value))}"
    return type(value).__name__


def _capture_python(generator: Any = random) -> dict[str, Any]:
    version, internal, gauss_next = generator.getstate()
    return {"version": version, "state": list(internal), "gauss_next": gauss_next}


def _python_tuple(value: Any) -> tuple:
    """Rebuild ``random.getstate()``'s tuple from its plain form (lists after a JSON round trip)."""
    try:
        internal = tuple(int(x) for x in value["state"])
        gauss = value["gauss_next"]
        return (int(value["version"]), internal, None if gauss is None else float(gauss))
    except (TypeError, KeyError, ValueError) as exc:
        raise RngStateError(f"bad Python random state: {exc}") from exc


def _capture_numpy(generator: Any = None) -> dict[str, Any] | None:
    np = sys.modules.get("numpy")
    if np is None:
        return None
    algorithm, keys, pos, has_gauss, cached = (generator or np.random).get_state(legacy=True)
    return {
        "algorithm": str(algorithm),
        "keys": [int(k) for k in keys],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _numpy_tuple(value: Any) -> tuple | None:
    """Rebuild ``np.random.get_state()``'s tuple; ``None`` (with a warning) without NumPy."""
    try:
        import numpy as np
    except ImportError:
        warnings.warn("state has a NumPy RNG state but NumPy is not installed", RngRestoreWarning)
        return None
    try:
        keys = np.asarray([int(k) for k in value["keys"]], dtype=np.uint32)
        return (str(value["algorithm"]), keys, int(value["pos"]),
                int(value["has_gauss"]), float(value["cached_gaussian"]))
    except (TypeError, KeyError, ValueError, OverflowError) as exc:
        raise RngStateError(f"bad NumPy RNG state: {exc}") from exc


def _capture_cuda(torch: Any) -> list[Any] | None:
    """One state per device, or ``None`` when CUDA is absent (recorded, not an error)."""
    if not torch.cuda.is_available():
        return None
    return list(torch.cuda.get_rng_state_all())


def _torch_states(cpu: Any, cuda: list[Any]) -> tuple[Any, list[Any]] | None:
    """Check the torch part; ``None`` when there is nothing to restore or no torch (warned)."""
    if cpu is None and not cuda:
        return None
    try:
        import torch
    except ImportError:
        warnings.warn("state has torch RNG states but torch is not installed", RngRestoreWarning)
        return None
    for tensor in ([cpu] if cpu is not None else []) + list(cuda):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8:
            raise RngStateError(f"torch RNG state must be a uint8 tensor, got {_describe(tensor)}")
    return cpu, list(cuda)


def _restore_torch(cpu: Any, cuda: list[Any]) -> None:
    import torch

    if cpu is not None:
        # clone: a view into a larger buffer (as checkpoint loaders return) crashes set_rng_state
        torch.set_rng_state(cpu.clone())
    if cuda:
        _restore_cuda(torch, cuda)


def _restore_cuda(torch: Any, states: list[Any]) -> None:
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device, device_state in enumerate(states[:here]):
        torch.cuda.set_rng_state(device_state.clone(), device)
    if here < len(states):
        warnings.warn(
            f"checkpoint has CUDA RNG states for {len(states)} devices, this machine has {here}: "
            f"restored {here}, skipped {len(states) - here}",
            RngRestoreWarning,
        )
