"""A peer rank that is gone: tell it from other failures, and end this process with status 77.

:class:`spotguard.run.Run` and the framework callbacks end a rank whose peer vanished the same way:
the cause is logged and recorded, and the process ends at once with ``EXIT_PEER_LOST`` (77) through
``os._exit``, because a process group whose peer is gone cannot be torn down (see
:mod:`spotguard.run`). The last committed checkpoint stands; relaunching the job resumes from it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, NoReturn

from spotguard._watchdog import run_exit_hooks
from spotguard.distributed import PeerLostError
from spotguard.exit_codes import EXIT_PEER_LOST

__all__ = ["exit_peer_lost", "exit_peer_lost_when_uncaught", "is_peer_failure"]

log = logging.getLogger(__name__)

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "pair closure",
              "NCCL communicator was aborted", "Socket Timeout")
"""What gloo and NCCL say when a collective fails because another rank's process is gone."""


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because a peer rank is gone (gloo, NCCL)."""
    if isinstance(exc, PeerLostError):
        return True
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _PEER_GONE)


def exit_peer_lost(error: object, record: Any, step: int) -> NoReturn:
    """Log ``error``, record it (a :class:`~spotguard._record.Recorder`) and exit 77 now."""
    log.error("%s; exiting %d: relaunch the job on every node, it resumes from the last committed "
              "checkpoint", error, EXIT_PEER_LOST)
    record.emit("peer_lost", step=step, error=str(error))
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    run_exit_hooks()  # loader workers are SIGKILLed: os._exit would leave them behind
    os._exit(EXIT_PEER_LOST)


def exit_peer_lost_when_uncaught(record: Any, step: Callable[[], int]) -> Callable[[], None]:
    """Make an uncaught peer failure end the program with 77 instead of 1 (``sys.excepthook``:
    for a loop spotguard does not see fail, such as the Hugging Face ``Trainer``'s, whose DDP
    backward meets the lost peer first). The traceback is printed as usual first. Returns the
    function that puts the previous hook back."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not is_peer_failure(exc):
            previous(kind, exc, tb)
            return
        sys.__excepthook__(kind, exc, tb)
        exit_peer_lost(exc, record, step())

    sys.excepthook = hook

    def restore() -> None:
        if sys.excepthook is hook:
            sys.excepthook = previous

    return restore
