"""Simulated Alibaba Cloud ECS metadata: the preemptible instance's termination time.

``GET /latest/meta-data/instance/spot/termination-time``: 404 while nothing is pending, else the
UTC deadline as plain text (``2015-01-05T18:02:00Z``). Hardened mode: ``PUT /latest/api/token``
with ``X-aliyun-ecs-metadata-token-ttl-seconds`` (1..21600, else 400) returns a token that GETs send
as ``X-aliyun-ecs-metadata-token``. With ``hardened=True`` (the default, like an instance set to
``HttpTokens=required``) a GET without a token gets **403**; with ``hardened=False`` (``optional``)
it is served. An unknown or expired token gets **401** in both modes. (Alibaba documents the modes
but not the exact statuses; these are the choices this simulator makes.)

Kinds: ``terminate`` (default deadline 300 s: the instance is released about 5 minutes after the
notice appears).
"""

from __future__ import annotations

import secrets
import threading

from ._events import Timers
from ._platform import Request, Response, html_error
from ._simulator import register_platform
from ._timefmt import rfc3339
from ._tokens import TokenGuardedSim

__all__ = ["AlibabaSim"]

_TERMINATION_PATH = "/latest/meta-data/instance/spot/termination-time"
@register_platform
class AlibabaSim(TokenGuardedSim):
    name = "alibaba"
    kinds = ("terminate",)
    settable = frozenset({"hardened"})
    server_header = "Tengine"
    ttl_header = "X-aliyun-ecs-metadata-token-ttl-seconds"
    token_header = "X-aliyun-ecs-metadata-token"
    missing_token_status = 403

    def __init__(self, cond: threading.Condition, timers: Timers, *, hardened: bool = True,
                 instance_id: str = "i-bp67acfmxazb4ph5p0l3") -> None:
        super().__init__(cond, timers)
        self.hardened = bool(hardened)
        self.instance_id = instance_id

    def default_deadline(self, kind: str) -> float:
        return 300.0

    def new_event_id(self, kind: str) -> str:
        return "ali-terminate-" + secrets.token_hex(6)

    def tokens_required(self) -> bool:
        return self.hardened

    def error(self, status: int) -> Response:
        return html_error(status)

    def route(self, req: Request) -> Response:
        if req.path == "/latest/meta-data/instance-id":
            return Response.text(200, self.instance_id)
        pending = self.active("terminate") if req.path == _TERMINATION_PATH else []
        return Response.text(200, rfc3339(pending[-1].deadline)) if pending else html_error(404)
