"""Session tokens for the metadata services that use them (AWS IMDSv2, Alibaba hardened mode).

Both work the same way: ``PUT /latest/api/token`` with a TTL header (1..21600 seconds, else 400)
returns an opaque token; later GETs send it in a token header. An unknown or expired token is
refused with 401 whatever the mode; a *missing* token is refused only when tokens are required
(the status for that is the platform's choice). Tokens expire on their TTL, or all at once through
:meth:`TokenStore.expire_all` (control call ``expire_tokens``) so clients' refresh paths can be tested.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, ClassVar

from ._events import Timers
from ._platform import PlatformSim, Request, Response

__all__ = ["TokenStore", "TokenGuardedSim", "MAX_TTL_SECONDS", "TOKEN_PATH"]

TOKEN_PATH = "/latest/api/token"

MAX_TTL_SECONDS = 21600
_MAX_TOKENS = 10_000


class TokenStore:
    """Issued tokens and their expiry times. Callers hold the simulator lock."""

    def __init__(self, ttl_header: str, token_header: str) -> None:
        self.ttl_header = ttl_header
        self.token_header = token_header
        self._expiry: dict[str, float] = {}
        self.issued = 0

    def issue(self, req: Request) -> tuple[str, int] | None:
        """Issue a token for a PUT; ``None`` when the TTL header is missing or out of range (400)."""
        try:
            ttl = int(req.headers.get(self.ttl_header, ""))
        except ValueError:
            return None
        if not 1 <= ttl <= MAX_TTL_SECONDS:
            return None
        self._prune()
        token = secrets.token_urlsafe(42)
        self._expiry[token] = time.time() + ttl
        self.issued += 1
        return token, ttl

    def check(self, req: Request, required: bool, missing_status: int = 401) -> int | None:
        """The status that refuses this GET, or ``None`` when it may proceed."""
        token = req.headers.get(self.token_header)
        if token is None:
            return missing_status if required else None
        expiry = self._expiry.get(token)
        return None if expiry is not None and expiry > time.time() else 401

    def expire_all(self) -> int:
        live = self.live()
        self._expiry.clear()
        return live

    def live(self) -> int:
        now = time.time()
        return sum(1 for expiry in self._expiry.values() if expiry > now)

    def _prune(self) -> None:
        now = time.time()
        for token in [t for t, expiry in self._expiry.items() if expiry <= now]:
            del self._expiry[token]
        while len(self._expiry) >= _MAX_TOKENS:  # bounded memory against a client that loops on PUT
            del self._expiry[next(iter(self._expiry))]


class TokenGuardedSim(PlatformSim):
    """A platform whose metadata GETs are guarded by :class:`TokenStore` tokens (AWS, Alibaba).

    Subclasses set the two header names, say whether a token is required now
    (:meth:`tokens_required`), render errors (:meth:`error`) and answer authorised GETs
    (:meth:`route`, called with the lock held).
    """

    ttl_header: ClassVar[str] = ""
    token_header: ClassVar[str] = ""
    missing_token_status: ClassVar[int] = 401

    def __init__(self, cond: threading.Condition, timers: Timers) -> None:
        super().__init__(cond, timers)
        self.tokens = TokenStore(self.ttl_header, self.token_header)

    def tokens_required(self) -> bool:
        return True

    def error(self, status: int) -> Response:
        raise NotImplementedError

    def route(self, req: Request) -> Response:
        raise NotImplementedError

    def expire_tokens(self) -> int:
        return self.tokens.expire_all()

    def extra_state(self) -> dict[str, Any]:
        return {"tokens": {"issued": self.tokens.issued, "live": self.tokens.live()}}

    def handle(self, req: Request) -> Response:
        with self.cond:
            if req.path == TOKEN_PATH:
                return self._put_token(req)
            if req.method not in ("GET", "HEAD"):
                return self.error(405)
            refused = self.tokens.check(req, self.tokens_required(), self.missing_token_status)
            return self.error(refused) if refused is not None else self.route(req)

    def _put_token(self, req: Request) -> Response:
        if req.method != "PUT":
            return self.error(405)
        issued = self.tokens.issue(req)
        if issued is None:
            return self.error(400)
        token, ttl = issued
        return Response.text(200, token, **{self.ttl_header: str(ttl)})
