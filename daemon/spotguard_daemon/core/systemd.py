"""systemd's notify protocol, with the standard library only (no sd_notify dependency).

With ``Type=notify`` systemd sets ``NOTIFY_SOCKET`` and waits for ``READY=1`` before it calls the
service started; ``WatchdogSec=`` sets ``WATCHDOG_USEC`` and expects ``WATCHDOG=1`` at least that
often (we send it every half period); ``STOPPING=1`` says a stop is under way. Without
``NOTIFY_SOCKET`` every call does nothing, so the daemon runs the same outside systemd.

:func:`system_stopping` tells a node shutdown (``systemctl is-system-running`` prints ``stopping``)
from a service stop or restart while the system keeps running (an upgrade).

Exceptions: none; a send that fails is logged at debug level and ignored. Sends never block: with
the receiver's queue full (a notify socket nobody reads), the state is dropped rather than the
daemon's loop stalled (a later ``WATCHDOG=1`` goes once there is room).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess

__all__ = ["notify", "watchdog_interval", "under_systemd", "system_stopping"]

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to systemd; True when a notify socket took it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)  # a receiver that does not read must not stall the daemon's loop
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.debug("sd_notify %s failed: %s", state, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WATCHDOG_USEC``), or None when not asked."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2e6, 0.01)
    except ValueError:
        return None


def under_systemd() -> bool:
    """True when systemd started this process as a service (it sets ``INVOCATION_ID``)."""
    return bool(os.environ.get("INVOCATION_ID"))


def system_stopping(timeout: float = 2.0) -> bool:
    """True when the whole system is shutting down or rebooting; also True when that cannot be
    told (no ``systemctl``, no answer), because stopping training needlessly costs a restart while
    missing a shutdown costs the work since the last checkpoint."""
    try:
        done = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cannot ask systemd whether the system is stopping (%s); assuming it is", exc)
        return True
    state = done.stdout.strip()
    return state not in ("running", "degraded", "starting", "initializing", "maintenance")
