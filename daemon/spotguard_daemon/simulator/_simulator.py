"""The :class:`Simulator`: one platform's metadata endpoints plus the control API, on one port.

Use it in-process (tests) or through :func:`serve` (``spotguard simulate``, ``python -m
spotguard_daemon.simulator``). The Python methods and the HTTP control API under ``/_sim/`` are the
same operations: ``schedule``, ``cancel``, ``fault``, ``clear``, ``expire_tokens``, ``set`` and
``state``.

Exceptions::

    ControlError             (from ._events) a control call with bad arguments; HTTP answers 400
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from ._events import ControlError, Timers
from ._faults import FaultBook
from ._http import SimServer
from ._platform import PlatformSim, Request, Response

__all__ = ["Simulator", "register_platform", "PLATFORMS"]

logger = logging.getLogger(__name__)

PLATFORMS: dict[str, type[PlatformSim]] = {}
_MAX_PATHS = 256


def register_platform(cls: type[PlatformSim]) -> type[PlatformSim]:
    PLATFORMS[cls.name] = cls
    return cls


class Simulator:
    """A running simulator of ``platform`` (``aws``, ``gcp``, ``azure``, ``alibaba``).

    Starts serving on construction; ``port=0`` picks a free port (see :attr:`url`). ``options`` are
    the platform's constructor options (e.g. ``imdsv1=True`` for aws, ``vm_name=`` for azure).
    :meth:`stop` ends every open connection, hanging ones included, within a fraction of a second.
    """

    def __init__(self, platform: str, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        if platform not in PLATFORMS:
            raise ValueError(f"unknown platform {platform!r}; one of {sorted(PLATFORMS)}")
        self.cond = threading.Condition()
        self._timers = Timers(self.cond)
        try:
            self.platform = PLATFORMS[platform](self.cond, self._timers, **options)
            self.faults = FaultBook(self.cond)
            self._requests: dict[str, Any] = {"total": 0, "faulted": 0, "by_path": {}}
            self._server = SimServer((host, port), self)
        except BaseException:
            self._timers.close()
            raise
        self.host, self.port = host, self._server.server_address[1]
        self._stopped = False
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"spotguard-sim-{platform}", daemon=True)
        self._thread.start()
        logger.info("simulator %s listening on %s", platform, self.url)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def __enter__(self) -> "Simulator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ operations

    def schedule(self, kind: str, in_seconds: float = 0.0, deadline_seconds: float | None = None,
                 resources: list[str] | None = None, event_type: str | None = None,
                 duration: float | None = None, **extra: Any) -> dict[str, Any]:
        """Schedule an event; returns it as JSON (``id``, ``flip_at`` and, once flipped, ``flipped_at``)."""
        event = self.platform.schedule(kind, in_seconds, deadline_seconds, resources, event_type,
                                       duration, **extra)
        with self.cond:
            return event.to_json()

    def cancel(self, id: str | None = None) -> list[str]:  # noqa: A002 (the control API's field)
        """Cancel one event, or all with ``None``; returns the ids cancelled."""
        return self.platform.cancel(id)

    def fault(self, mode: str, count: int | None = None, seconds: float | None = None,
              delay: float | None = None) -> dict[str, Any]:
        return self.faults.add(mode, count, seconds, delay).to_json()

    def clear(self, what: str = "all") -> None:
        """Remove faults (``faults``), events (``events``) or both (``all``); acks are kept."""
        if what not in ("all", "faults", "events"):
            raise ControlError("what must be all, faults or events")
        if what in ("all", "faults"):
            self.faults.clear()
        if what in ("all", "events"):
            self.platform.clear_events()

    def expire_tokens(self) -> int:
        with self.cond:
            return self.platform.expire_tokens()

    def set(self, **fields: Any) -> None:
        self.platform.set(**fields)

    def state(self) -> dict[str, Any]:
        with self.cond:
            requests = {**self._requests, "by_path": dict(self._requests["by_path"])}
            return {**self.platform.state(), "url": self.url, "now": time.time(),
                    "faults": self.faults.to_json(), "requests": requests}

    def stop(self) -> None:
        """Stop serving and end every open request promptly. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with self.cond:
            self.platform.stopping = True
            self.cond.notify_all()
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._timers.close()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------ called by the HTTP handler

    def count(self, req: Request, faulted: bool) -> None:
        with self.cond:
            self._requests["total"] += 1
            self._requests["faulted"] += int(faulted)
            by_path = self._requests["by_path"]
            key = f"{req.method} {req.path}" if len(by_path) < _MAX_PATHS else "other"
            by_path[key] = by_path.get(key, 0) + 1

    def control(self, req: Request) -> Response:
        """Answer one ``/_sim/`` request: 200 JSON, 400 with ``{"error": ...}``, 404 or 405."""
        op = req.path[len("/_sim/"):].strip("/")
        if op not in _OPS:
            return Response.json(404, {"error": f"no control operation {op!r}; one of {sorted(_OPS)}"})
        method, call = _OPS[op]
        if req.method != method:
            return Response.json(405, {"error": f"{op} takes {method}"}, Allow=method)
        try:
            body = json.loads(req.body or b"{}")
            if not isinstance(body, dict):
                raise ControlError("the body must be a JSON object")
            return Response.json(200, call(self, body))
        except (ControlError, ValueError, TypeError) as exc:
            return Response.json(400, {"error": str(exc)})


def _schedule(sim: Simulator, body: dict[str, Any]) -> dict[str, Any]:
    if "kind" not in body:
        raise ControlError("kind is required")
    return sim.schedule(**body)


def _clear(sim: Simulator, body: dict[str, Any]) -> dict[str, Any]:
    sim.clear(**body)
    return {"cleared": body.get("what", "all")}


def _set(sim: Simulator, body: dict[str, Any]) -> dict[str, Any]:
    sim.set(**body)
    return sim.platform.options()


_OPS: dict[str, tuple[str, Any]] = {
    "schedule": ("POST", _schedule),
    "cancel": ("POST", lambda sim, body: {"cancelled": sim.cancel(**body)}),
    "fault": ("POST", lambda sim, body: sim.fault(**body)),
    "clear": ("POST", _clear),
    "expire_tokens": ("POST", lambda sim, body: {"expired": sim.expire_tokens(**body)}),
    "set": ("POST", _set),
    "state": ("GET", lambda sim, body: sim.state()),
}
