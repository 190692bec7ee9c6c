"""The pickle-free encoding of a state tree: JSON for structure, raw bytes for tensors.

A value is encoded as plain JSON when JSON keeps it exactly (``None``, ``bool``, ``int``, ``str``,
finite ``float``); everything else becomes a one-key tagged object, so a decoder never guesses::

    {"dict": [[k, v], ...]}  {"odict": [...]}  {"list": [...]}  {"tuple": [...]}  {"size": [...]}
    {"float": "nan"|"inf"|"-inf"}  {"bytes": "<base64>"}  {"dtype": "bfloat16"}  {"device": "cpu"}
    {"tensor": i}  {"ndarray": i, "dtype": "<u4", "shape": [...]}  {"npscalar": "<f8", "hex": "..."}

Dict keys go through the same encoder, so int keys (optimizer ``state`` is keyed by parameter id) and
tuple keys stay what they were. ``i`` indexes the snapshot's tensor list; a numpy array is stored as
the uint8 tensor of its bytes plus its dtype string. Tensor dtypes are stored by name and resolved
against an allow-list of ``torch.dtype`` attributes, so loading never evaluates anything.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from spotguard.checkpoint.errors import CheckpointCorruptError, UnsupportedStateError

__all__ = ["encode", "decode", "dtype_name", "dtype_from_name"]

_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CheckpointCorruptError(f"unknown tensor dtype {name!r}") from None


Path = "str | tuple[Path, Any]"
"""Where a value sits, for error messages only: a name, or ``(parent, key)``, rendered on error."""

_PLAIN = frozenset({type(None), bool, int, str})
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


def encode(obj: Any, tensors: list[torch.Tensor], path: Path = "state") -> Any:
    """JSON-able form of ``obj``; tensors (and numpy arrays as bytes) are appended to ``tensors``."""
    kind = type(obj)  # exact types first: a state of 60,000 tensors is mostly these
    if kind in _TENSORS:
        return {"tensor": _add_tensor(obj, tensors, path)}
    if kind in _PLAIN:
        return obj
    if kind is float:
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, (np.ndarray, np.generic)):  # before float: np.float64 is a float subclass
        return _encode_numpy(obj, tensors, path)
    if isinstance(obj, torch.Tensor):
        return {"tensor": _add_tensor(obj, tensors, path)}
    if kind is dict or isinstance(obj, Mapping):
        tag = "odict" if isinstance(obj, OrderedDict) else "dict"
        return {tag: [[encode(k, tensors, path), encode(v, tensors, (path, k))] for k, v in obj.items()]}
    return _encode_other(obj, tensors, path)


def _where(path: Path) -> str:
    if isinstance(path, str):
        return path
    parent, key = path
    return f"{_where(parent)}[{key!r}]"


def _encode_other(obj: Any, tensors: list[torch.Tensor], path: Path) -> Any:
    if isinstance(obj, (list, tuple)):
        tag = "size" if isinstance(obj, torch.Size) else "list" if isinstance(obj, list) else "tuple"
        if tag == "tuple" and type(obj) is not tuple:
            raise UnsupportedStateError(f"{_where(path)}: named tuple {type(obj).__name__} is not supported")
        return {tag: [encode(v, tensors, (path, i)) for i, v in enumerate(obj)]}
    if isinstance(obj, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, torch.dtype):
        return {"dtype": dtype_name(obj)}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    raise UnsupportedStateError(f"{_where(path)}: values of type {type(obj).__qualname__} cannot be checkpointed")


def _add_tensor(t: torch.Tensor, tensors: list[torch.Tensor], path: Path) -> int:
    if t.layout is not torch.strided or t.is_quantized or (
            type(t) not in _TENSORS and not isinstance(t, torch.nn.Parameter)):
        raise UnsupportedStateError(f"{_where(path)}: only dense strided tensors are supported, got {type(t).__name__}")
    tensors.append(t.detach())
    return len(tensors) - 1


def _encode_numpy(a: np.ndarray | np.generic, tensors: list[torch.Tensor], path: Path) -> Any:
    if a.dtype.hasobject:
        raise UnsupportedStateError(f"{_where(path)}: numpy object arrays cannot be checkpointed")
    if isinstance(a, np.generic):
        return {"npscalar": a.dtype.str, "hex": a.tobytes().hex()}
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    index = _add_tensor(torch.from_numpy(raw), tensors, path)
    return {"ndarray": index, "dtype": a.dtype.str, "shape": list(a.shape)}


def decode(obj: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    """Inverse of :func:`encode`; ``tensor(i)`` returns the i-th stored tensor."""
    if not isinstance(obj, (dict, list)):
        return obj
    if not isinstance(obj, dict) or len(obj) not in (1, 2, 3):
        raise CheckpointCorruptError(f"malformed tree node {str(obj)[:80]!r}")
    tag, value = next(iter(obj.items()))
    try:
        return _DECODERS[tag](obj, value, tensor)
    except KeyError:
        raise CheckpointCorruptError(f"unknown tree tag {tag!r}") from None


def _numpy_dtype(name: Any) -> np.dtype:
    dtype = np.dtype(str(name))
    if dtype.hasobject:
        raise CheckpointCorruptError(f"numpy dtype {name!r} is not allowed")
    return dtype


def _decode_numpy(obj: dict, value: Any, tensor: Callable[[int], torch.Tensor]) -> np.ndarray:
    raw = tensor(value).numpy()
    return np.frombuffer(raw.tobytes(), dtype=_numpy_dtype(obj["dtype"])).reshape(obj["shape"]).copy()


def _pairs(value: Any, tensor: Callable[[int], torch.Tensor]) -> list[tuple[Any, Any]]:
    return [(decode(k, tensor), decode(v, tensor)) for k, v in value]


_DECODERS: dict[str, Callable[[dict, Any, Callable[[int], torch.Tensor]], Any]] = {
    "dict": lambda o, v, t: dict(_pairs(v, t)),
    "odict": lambda o, v, t: OrderedDict(_pairs(v, t)),
    "list": lambda o, v, t: [decode(x, t) for x in v],
    "tuple": lambda o, v, t: tuple(decode(x, t) for x in v),
    "size": lambda o, v, t: torch.Size(v),
    "float": lambda o, v, t: float(v),
    "bytes": lambda o, v, t: base64.b64decode(v),
    "dtype": lambda o, v, t: dtype_from_name(v),
    "device": lambda o, v, t: torch.device(v),
    "tensor": lambda o, v, t: t(v),
    "ndarray": _decode_numpy,
    "npscalar": lambda o, v, t: np.frombuffer(bytes.fromhex(o["hex"]), dtype=_numpy_dtype(v))[0],
}
