"""Run one simulator in the foreground until SIGINT or SIGTERM (the command-line entry points)."""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

from ._simulator import Simulator

__all__ = ["serve", "parse_option", "DEFAULT_PORT"]

DEFAULT_PORT = 1338
"""Port of the command-line simulator when none is given (amazon-ec2-metadata-mock's default)."""


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line; VALUE is JSON when it parses (``true``, ``2.5``), else text.

    Dashes in KEY become underscores (``vm-name=x`` is ``vm_name``). Raises ``ValueError``.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"option {text!r} is not KEY=VALUE")
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip().replace("-", "_"), parsed


def serve(platform: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, **options: Any) -> None:
    """Serve ``platform`` on ``host:port`` until SIGINT/SIGTERM; call from the main thread.

    Prints exactly one line to stdout once listening, e.g. ``spotguard simulator aws listening on
    http://127.0.0.1:1338 (control API: http://127.0.0.1:1338/_sim/)``, so a parent process can
    read the port when ``port=0``.
    """
    done = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Simulator(platform, host, port, **options) as sim:
            print(f"spotguard simulator {platform} listening on {sim.url} "
                  f"(control API: {sim.url}/_sim/)", flush=True)
            while not done.wait(0.5):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
