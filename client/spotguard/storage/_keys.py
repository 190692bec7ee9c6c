"""Where a checkpoint's file bodies lie in a durable store: ``objects/sha256/<hex>``, content
addressed and shared by every job (the whole layout: :mod:`.durable`). Both halves of durable
storage name objects with it: :mod:`.durable` writes them, :mod:`._restore` reads them.
"""

from __future__ import annotations

__all__ = ["OBJECTS", "object_key"]

OBJECTS = "objects/sha256/"


def object_key(sha256: str) -> str:
    """The key of the object whose body hashes to ``sha256`` (hex)."""
    return OBJECTS + sha256
