"""Exceptions of the checkpoint engine, all rooted at :class:`CheckpointError`.

Exceptions::

    CheckpointError              a save or load could not be done; the previous checkpoint stays loadable
    ├── CheckpointDiskFullError  ENOSPC while writing: names the root and the bytes the save needed
    ├── CheckpointCorruptError   a checkpoint on disk is incomplete, altered or not in this format
    └── UnsupportedStateError    the state holds a value this format cannot store (names its path)

OS errors are translated once, at the file-system boundary, with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointDiskFullError",
    "CheckpointCorruptError",
    "UnsupportedStateError",
]


class CheckpointError(Exception):
    """A save or load failed. A failed save never touches the previous committed checkpoint."""


class CheckpointDiskFullError(CheckpointError):
    """The file system ran out of space during a save; the partial directory has been removed."""

    def __init__(self, root: object, needed_bytes: int, free_bytes: int | None) -> None:
        free = "unknown" if free_bytes is None else f"{free_bytes}"
        super().__init__(
            f"no space left under checkpoint root {root}: the checkpoint needs {needed_bytes} bytes, "
            f"{free} bytes are free; the partial checkpoint was removed"
        )
        self.root = root
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class CheckpointCorruptError(CheckpointError):
    """A checkpoint directory that is incomplete, altered, or not a spotguard checkpoint."""


class UnsupportedStateError(CheckpointError, TypeError):
    """A value in the state that has no faithful pickle-free encoding (e.g. an arbitrary object)."""
