"""Snapshot a training state into reusable CPU buffers: the only part of a save the loop waits for.

:meth:`Stager.snapshot` calls ``state_dict()`` on stateful entries, encodes the non-tensor tree to
JSON-able values at once (so later mutation of Python values cannot leak into the checkpoint), and
copies every tensor into a staging buffer with one ``copy_``. Buffers are allocated on the first save
and reused while the tensor's dtype and shape stay the same, so a steady-state save is a memcpy with
no allocation or page faults; they are pinned when CUDA is available so device-to-host copies are
asynchronous. The caller must not snapshot again before the previous snapshot has been written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from spotguard.checkpoint.format import encode

__all__ = ["Snapshot", "Stager", "entry_kind"]


@dataclass
class Snapshot:
    """A consistent CPU copy of a state: ``entries`` are ``[name, kind, encoded tree]``."""

    entries: list[list[Any]]
    tensors: list[torch.Tensor]
    nbytes: int
    ends: list[int] = field(default_factory=list)
    """``ends[k]``: one past the index of entry k's last tensor (entries own contiguous runs)."""


def entry_kind(value: Any) -> str:
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return "stateful"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "mapping" if isinstance(value, Mapping) else "value"


class Stager:
    """Owns the staging buffers; one instance per :class:`~spotguard.checkpoint.Checkpointer`."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: list[torch.Tensor] = []

    def snapshot(self, state: Mapping[str, Any], names: Iterable[str] | None = None) -> Snapshot:
        """Copy the entries of ``state`` (all, or only ``names``) into the staging buffers."""
        wanted = None if names is None else set(names)
        sources: list[torch.Tensor] = []
        entries, ends = [], []
        for name, value in state.items():
            if wanted is None or name in wanted:
                kind = entry_kind(value)
                tree = value.state_dict() if kind == "stateful" else value
                entries.append([str(name), kind, encode(tree, sources, str(name))])
                ends.append(len(sources))
        staged = [self._stage(i, t) for i, t in enumerate(sources)]
        del self._buffers[len(sources) :]
        if any(t.is_cuda for t in sources):
            torch.cuda.synchronize()
        return Snapshot(entries, staged, sum(t.numel() * t.element_size() for t in staged), ends)

    def _stage(self, index: int, src: torch.Tensor) -> torch.Tensor:
        if index < len(self._buffers):
            buf = self._buffers[index]
            if buf.dtype != src.dtype or buf.shape != src.shape:
                buf = self._buffers[index] = self._new_buffer(src)
        else:
            buf = self._new_buffer(src)
            self._buffers.append(buf)
        buf.copy_(src, non_blocking=src.is_cuda)
        return buf

    def _new_buffer(self, src: torch.Tensor) -> torch.Tensor:
        return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=self._pin)

    def release(self) -> None:
        """Drop the staging buffers (the next snapshot allocates again)."""
        self._buffers = []
