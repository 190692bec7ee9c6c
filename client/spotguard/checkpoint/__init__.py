"""Atomic, verified, pickle-free full-state checkpoints with asynchronous saves.

See :class:`Checkpointer`; the on-disk layout is described in :mod:`spotguard.checkpoint.layout`
and the commit protocol in :mod:`spotguard.checkpoint.commit`.
"""

from spotguard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointDiskFullError,
    CheckpointError,
    UnsupportedStateError,
)
from spotguard.checkpoint.layout import CommitInfo
from spotguard.checkpoint.manager import Checkpointer, SaveStats

__all__ = [
    "Checkpointer",
    "CommitInfo",
    "SaveStats",
    "CheckpointError",
    "CheckpointDiskFullError",
    "CheckpointCorruptError",
    "UnsupportedStateError",
]
