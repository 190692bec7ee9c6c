"""The ``manual`` source: notices injected with ``spotguard notify`` (drills, scripted stops).

A push source, not a polled watcher: each ``notify`` request becomes one new notice with an id of
its own (``manual:<kind>:<random>``), so two drills never merge; it stays pending until its
deadline is long past (the store expires it) or the daemon cancels it.

Exceptions: none.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from spotguard.protocol import TERMINATING_KINDS, Notice, NotifyRequest, utcnow

__all__ = ["SOURCE", "manual_notice"]

SOURCE = "manual"


def manual_notice(request: NotifyRequest, *, platform: str, now: datetime | None = None) -> Notice:
    """The notice for one ``notify`` request; ``deadline_seconds`` counts from ``now``."""
    now = now or utcnow()
    deadline = None if request.deadline_seconds is None else now + timedelta(seconds=request.deadline_seconds)
    return Notice(
        id=f"{SOURCE}:{request.kind.value}:{uuid.uuid4().hex[:12]}",
        platform=platform or "none",
        kind=request.kind,
        deadline=deadline,
        received_at=now,
        terminating=request.kind in TERMINATING_KINDS,
        source=SOURCE,
        detail=request.detail or "manual notice",
    )
