"""The daemon's two ZeroMQ sockets: PUB for events, ROUTER for requests, and their heartbeat.

Events go out as ``[topic, json]`` (topics per :mod:`spotguard.protocol`). Every request is one JSON
frame, checked by :func:`~spotguard.protocol.decode_request` against ``zmq.max_message_bytes`` before
anything else looks at it; whatever is wrong with it (not JSON, too large, an unknown type, a wrong
field) gets an error :class:`~spotguard.protocol.Reply` and the loop goes on. Messages that do not even
carry a routable envelope are dropped. ``ZMQ_MAXMSGSIZE`` is set to twice the limit (plus a little)
so a moderately oversized request still gets a clear error reply while a huge one is cut off by
libzmq before it is buffered (the peer is disconnected).

``ipc://`` sockets live in a directory created 0700 and are made 0600 (bound under umask 077, then
chmod), so only the daemon's user can talk to it. libzmq silently takes over an ``ipc://`` path that
another process is bound to, so :func:`lock_runtime_dir` takes an exclusive ``flock`` first and a
second daemon on the same runtime directory fails with a clear error.

Heartbeats carry the pending notice ids every ``heartbeat_interval``, so a subscriber that joined
late (ZeroMQ's slow joiner) or lost a message can tell, and ask ``status`` for the notice itself.

Exceptions::

    ServerError              the sockets cannot be set up (bad directory, another daemon running)
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from pathlib import Path
from typing import Awaitable, Callable

import zmq
import zmq.asyncio
from pydantic import BaseModel
from spotguard.protocol import HeartbeatEvent, ProtocolError, Reply, Request, decode_request, encode

__all__ = ["Server", "ServerError", "secure_dir", "lock_runtime_dir", "ipc_path"]

log = logging.getLogger(__name__)

PUB_LINGER_MS = 500
"""How long closing waits to flush events still queued (the last notice before exit)."""

Handler = Callable[[Request], Awaitable[Reply]]
RequestObserver = Callable[[str, bool], None]


class ServerError(RuntimeError):
    """The sockets cannot be set up; the message says what to fix."""


def secure_dir(path: Path) -> None:
    """Create ``path`` 0700 (parents too), or tighten an existing one we own; refuse someone else's."""
    path.mkdir(parents=True, mode=0o700, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.geteuid():
        raise ServerError(f"{path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)


def lock_runtime_dir(runtime_dir: Path) -> int:
    """Hold ``daemon.lock`` in the runtime directory for the life of the process; return its fd."""
    secure_dir(runtime_dir)
    fd = os.open(runtime_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ServerError(f"another spotguard daemon is running with runtime_dir {runtime_dir}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


class Server:
    """Binds the PUB and ROUTER sockets and runs the request loop and the heartbeat loop.

    ``handler`` answers a validated request; it should be quick (no network I/O) because requests
    are answered one at a time, in order. ``pending_ids`` feeds the heartbeat.
    """

    def __init__(self, *, pub_endpoint: str, request_endpoint: str, handler: Handler,
                 pending_ids: Callable[[], list[str]], daemon_id: str,
                 max_message_bytes: int = 64 * 1024, heartbeat_interval: float = 1.0,
                 observe: RequestObserver | None = None) -> None:
        self.pub_endpoint = pub_endpoint
        self.request_endpoint = request_endpoint
        self._handler = handler
        self._pending_ids = pending_ids
        self._daemon_id = daemon_id
        self._limit = max_message_bytes
        self._interval = heartbeat_interval
        self._observe = observe or (lambda kind, ok: None)
        self._ctx = zmq.asyncio.Context()
        self._pub_ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._seq = 0
        self._bound_paths: list[Path] = []

    # ------------------------------------------------------------------ set-up

    def bind(self) -> None:
        """Bind both sockets; ``tcp://...:0`` endpoints are replaced by the port actually bound."""
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        self.pub_endpoint = self._bind(self._pub, self.pub_endpoint)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 2 * self._limit + 1024)
        self.request_endpoint = self._bind(self._router, self.request_endpoint)
        log.info("serving requests on %s, events on %s", self.request_endpoint, self.pub_endpoint)

    def _bind(self, sock: zmq.Socket, endpoint: str) -> str:
        path = ipc_path(endpoint)
        if path is None:
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                raise ServerError(f"cannot bind {endpoint}: {exc}") from None
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        secure_dir(path.parent)
        old = os.umask(0o077)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise ServerError(f"cannot bind {endpoint}: {exc}") from None
        finally:
            os.umask(old)
        self._bound_paths.append(path)
        os.chmod(path, 0o600)
        return endpoint

    def close(self) -> None:
        """Close the sockets and remove ``ipc://`` files; safe to call twice."""
        for sock, linger in ((self._pub, PUB_LINGER_MS), (self._router, 0)):
            if sock is not None and not sock.closed:
                sock.close(linger=linger)
        for path in self._bound_paths:  # only files we bound: never another daemon's
            path.unlink(missing_ok=True)
        self._bound_paths.clear()
        self._ctx.term()
        self._pub_ctx.term()

    # ------------------------------------------------------------------ events

    def publish(self, event: BaseModel) -> None:
        """Send one event now; never blocks (PUB drops for a subscriber that is too slow)."""
        assert self._pub is not None, "bind() first"
        topic = getattr(event, "type").encode()
        self._pub.send_multipart([topic, encode(event)], flags=zmq.NOBLOCK)

    async def heartbeats(self) -> None:
        """Publish a heartbeat every interval, drift-free, until cancelled."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            self._seq += 1
            self.publish(HeartbeatEvent(seq=self._seq, daemon_id=self._daemon_id,
                                        pending=self._pending_ids(), interval=self._interval))
            next_at += self._interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    # ------------------------------------------------------------------ requests

    async def serve(self) -> None:
        """Answer requests until cancelled; no message can end the loop."""
        assert self._router is not None, "bind() first"
        while True:
            frames = await self._router.recv_multipart()
            reply_to, body = _envelope(frames)
            if reply_to is None:
                log.debug("dropped a message without a routable envelope (%d frames)", len(frames))
                continue
            reply = await self._answer(body)
            with contextlib.suppress(zmq.ZMQError):
                await self._router.send_multipart([*reply_to, encode(reply)], flags=zmq.NOBLOCK)

    async def _answer(self, body: list[bytes]) -> Reply:
        if len(body) != 1:
            self._observe("invalid", False)
            return Reply(ok=False, error=f"expected one JSON frame, got {len(body)}")
        try:
            request = decode_request(body[0], limit=self._limit)
        except ProtocolError as exc:
            self._observe("invalid", False)
            return Reply(ok=False, error=str(exc))
        except Exception as exc:  # a parser bug must not end the request loop
            log.warning("undecodable request: %s: %s", type(exc).__name__, exc)
            self._observe("invalid", False)
            return Reply(ok=False, error="invalid message")
        try:
            reply = await self._handler(request)
        except Exception:
            log.exception("handling a %s request failed", request.type)
            reply = Reply(ok=False, error="internal error; see the daemon's log")
        self._observe(request.type, reply.ok)
        return reply


def _envelope(frames: list[bytes]) -> tuple[list[bytes] | None, list[bytes]]:
    """Split ROUTER frames into (reply envelope, body): REQ peers send ``[id, b"", body...]``,
    DEALER peers ``[id, body]``. Anything else has no envelope we can answer."""
    if len(frames) >= 3 and frames[1] == b"":
        return frames[:2], frames[2:]
    if len(frames) == 2:
        return frames[:1], frames[1:]
    return None, []
