"""Faithful local metadata endpoints for AWS, GCP, Azure and Alibaba, with a control API.

``Simulator(platform, host="127.0.0.1", port=0, **options)`` runs one platform's metadata service
and the JSON control API (``/_sim/schedule``, ``cancel``, ``fault``, ``clear``, ``expire_tokens``,
``set``, ``state``) on one loopback port, in background threads; :func:`serve` runs one in the
foreground until SIGINT/SIGTERM (``spotguard simulate``, ``python -m spotguard_daemon.simulator``).

Exceptions::

    ControlError             a control call with bad arguments (HTTP: 400 with {"error": ...})
"""

from __future__ import annotations

from ._events import ControlError
from ._serve import parse_option, serve
from ._simulator import PLATFORMS, Simulator
from . import alibaba, aws, azure, gcp  # noqa: F401  (register the platforms)

__all__ = ["Simulator", "serve", "parse_option", "ControlError", "PLATFORMS"]
