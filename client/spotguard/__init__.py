"""spotguard: training jobs that survive spot and preemptible interruptions.

The easy path is :class:`Run`; its parts (:class:`Checkpointer`, :class:`Guard`, :class:`Cadence`,
:class:`ResumableSampler`, :mod:`spotguard.rng`) can be used on their own. The public surface is
``__all__``; modules and names starting with ``_`` are private.

``import spotguard`` stays light: it imports neither torch nor the daemon's dependencies. Names whose
module needs torch (:class:`Run`, :class:`Checkpointer` and its errors, :class:`DataLoader`, :func:`ignore_stop_signals`) are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spotguard import _fork, rng  # noqa: F401 (_fork: one warning at a fork that can hang the child)
from spotguard._console import handler as console_handler
from spotguard.cadence import Cadence, daly_interval, young_interval
from spotguard.exit_codes import EXIT_FORCED, EXIT_PEER_LOST, EXIT_PREEMPTED
from spotguard.guard import Guard
from spotguard.protocol import Kind, Notice
from spotguard.sampler import LoaderState, NotExactWarning, ResumableSampler

if TYPE_CHECKING:
    from spotguard.checkpoint import CheckpointError, Checkpointer, CommitInfo
    from spotguard.data import DataLoader, ignore_stop_signals
    from spotguard.run import Run

__version__ = "0.1.0"

__all__ = [
    "console_handler",
    "Run",
    "Checkpointer",
    "CommitInfo",
    "CheckpointError",
    "Guard",
    "Notice",
    "Kind",
    "Cadence",
    "young_interval",
    "daly_interval",
    "ResumableSampler",
    "LoaderState",
    "DataLoader",
    "ignore_stop_signals",
    "NotExactWarning",
    "rng",
    "EXIT_PREEMPTED",
    "EXIT_FORCED",
    "EXIT_PEER_LOST",
    "__version__",
]

_LAZY = {
    "Run": "spotguard.run",
    "Checkpointer": "spotguard.checkpoint",
    "CommitInfo": "spotguard.checkpoint",
    "CheckpointError": "spotguard.checkpoint",
    "DataLoader": "spotguard.data",
    "ignore_stop_signals": "spotguard.data",
}


def __getattr__(name: str) -> Any:
    """Load the torch-dependent names on first use (PEP 562)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'spotguard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
