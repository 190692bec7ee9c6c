"""The one durability primitive both the checkpoint engine and the stores need (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir"]


def fsync_dir(path: Path) -> None:
    """Make the entries of ``path`` (creations, renames, removals) durable: a rename survives a
    power cut only once its parent directory is fsynced."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
