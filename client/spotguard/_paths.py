"""Where the daemon's sockets live, computed the same way by the daemon and its clients.

Both sides read the same environment variables as the daemon's settings
(``SPOTGUARD_RUNTIME_DIR``, ``SPOTGUARD_ZMQ__PUB_ENDPOINT``, ``SPOTGUARD_ZMQ__REQUEST_ENDPOINT``), so a
training process started beside a daemon finds it without configuration.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_runtime_dir", "pub_endpoint", "request_endpoint"]


def default_runtime_dir() -> Path:
    """``$SPOTGUARD_RUNTIME_DIR``, ``$RUNTIME_DIRECTORY`` (systemd), ``/run/spotguard`` as root,
    else ``$XDG_RUNTIME_DIR/spotguard``, else ``/tmp/spotguard-<uid>``."""
    if os.environ.get("SPOTGUARD_RUNTIME_DIR"):
        return Path(os.environ["SPOTGUARD_RUNTIME_DIR"])
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path("/run/spotguard")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "spotguard" if xdg else Path(f"/tmp/spotguard-{os.geteuid()}")


def pub_endpoint() -> str:
    return os.environ.get("SPOTGUARD_ZMQ__PUB_ENDPOINT") or f"ipc://{default_runtime_dir()}/events.sock"


def request_endpoint() -> str:
    return os.environ.get("SPOTGUARD_ZMQ__REQUEST_ENDPOINT") or f"ipc://{default_runtime_dir()}/requests.sock"
