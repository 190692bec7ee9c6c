"""The ``signal`` source: SIGTERM or SIGINT to the daemon itself becomes a notice for the clients.

Kubernetes (pod deletion, node drain), ``docker stop``, RunPod and Slurm's ``--signal=B:TERM@N``
stop a machine's work by signalling every process, the daemon included, then kill after a grace
period. The daemon turns its own signal into a ``signal`` notice whose deadline is now plus
``signal.grace``, so clients that did not get the signal themselves (another container, another
process group) still checkpoint in time.

The notice is ephemeral: it is not written to the state file, since a daemon that starts again
was not necessarily stopped by the platform.

Exceptions: none.
"""

from __future__ import annotations

import signal as _signal
from datetime import datetime, timedelta

from spotguard.protocol import Kind, Notice, utcnow

__all__ = ["SOURCE", "HANDLED", "signal_notice", "signal_name"]

SOURCE = "signal"
HANDLED = (_signal.SIGTERM, _signal.SIGINT)
"""Signals the daemon turns into a notice (a second one makes it exit at once)."""


def signal_name(signum: int) -> str:
    return _signal.Signals(signum).name


def signal_notice(signum: int, *, grace: float, platform: str, now: datetime | None = None) -> Notice:
    """The notice for the daemon having received ``signum``, due ``grace`` seconds from ``now``."""
    now = now or utcnow()
    name = _signal.Signals(signum).name
    deadline = now + timedelta(seconds=grace)
    return Notice(
        id=f"{SOURCE}:{name}:{deadline.strftime('%Y-%m-%dT%H:%M:%S.%fZ')}",
        platform=platform or "none",
        kind=Kind.SIGNAL,
        deadline=deadline,
        received_at=now,
        terminating=True,
        source=SOURCE,
        detail=f"the spotguard daemon received {name}",
    )
