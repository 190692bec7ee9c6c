"""The daemon's two ZeroMQ sockets: PUB for events, ROUTER for requests, and their heartbeat.

Events go out as ``[topic, json]`` (topics per :mod:`spotguard.protocol`). Every request is one JSON
frame, checked by :func:`~spotguard.protocol.decode_request` against ``zmq.max_message_bytes`` before
anything else looks at it; whatever is wrong with it (not JSON, too large, an unknown type, a wrong
field) gets an error :class:`~spotguard.protocol.Reply` and the loop goes on. Messages that do not even
carry a routable envelope are dropped. ``ZMQ_MAXMSGSIZE`` is set to twice the limit (plus a little)
so a moderately oversized request still gets a clear error reply while a huge one is cut off by
libzmq before it is buffered (the peer is disconnected).

``ipc://`` sockets are made 0600 (bound under umask 077, then chmod), so only the daemon's user can
talk to them. The runtime directory is created 0700; one that already exists must belong to the
daemon's user and be writable by nobody else, or the daemon refuses to start (a directory it did not
create is never chmodded: an ``ipc://`` endpoint in a shared 1777 directory leaves it as it is).
libzmq silently takes over an ``ipc://`` path that another process is bound to, so
:func:`lock_runtime_dir` takes an exclusive ``flock`` first and a second daemon on the same runtime
directory fails with a clear error.

Who sent a request: on ``ipc://`` the kernel's credentials of the peer (``SO_PEERCRED``, which
libzmq reports as the ``Peer-Address`` property ``host:uid:gid:pid`` of every message); the
handler reads them from :data:`current_peer`. A ``tcp://`` peer cannot be identified: its
:class:`Peer` has ``uid=None`` (see :mod:`spotguard_daemon.core.handlers` for what that allows).

No message can end the request loop or the daemon: a handler that raises, or a reply that cannot be
encoded (a path that is not UTF-8), becomes an error reply, logged once per cause. The loop yields
to the event loop every ``YIELD_EVERY`` requests so a flood cannot starve heartbeats and
housekeeping, and the sockets' high-water marks bound what a flood or a peer that never reads can
make the daemon hold in memory.

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
import stat
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import zmq
import zmq.asyncio
from pydantic import BaseModel
from spotguard.protocol import HeartbeatEvent, ProtocolError, Reply, Request, decode_request, encode

__all__ = ["Server", "ServerError", "Peer", "current_peer", "secure_dir", "lock_runtime_dir",
           "ipc_path"]

log = logging.getLogger(__name__)

PUB_LINGER_MS = 500
"""How long closing waits to flush events still queued (the last notice before exit)."""
ROUTER_HWM = 1000
"""Messages queued per peer in each direction; with ``ZMQ_MAXMSGSIZE`` this bounds a flood's memory."""
PUB_HWM = 1000
"""Events queued per subscriber; a subscriber that never reads loses the oldest beyond this."""
YIELD_EVERY = 64

Handler = Callable[[Request], Awaitable[Reply]]
RequestObserver = Callable[[str, bool], None]


class ServerError(RuntimeError):
    """The sockets cannot be set up; the message says what to fix."""


@dataclass(frozen=True)
class Peer:
    """The sender of one request: kernel credentials on ``ipc://``, ``uid=None`` when unknown."""

    uid: int | None = None
    pid: int | None = None

    @classmethod
    def of(cls, frame: zmq.Frame) -> "Peer":
        """Parse libzmq's ``Peer-Address`` of an ``ipc://`` message (``host:uid:gid:pid``)."""
        try:
            _, uid, _, pid = frame.get("Peer-Address").rsplit(":", 3)
            return cls(int(uid), int(pid))
        except (zmq.ZMQError, ValueError):
            return cls()


current_peer: ContextVar[Peer] = ContextVar("current_peer", default=Peer())
"""The peer of the request being handled (set by :meth:`Server.serve` around each handler call)."""


def secure_dir(path: Path) -> None:
    """Create ``path`` 0700 (parents too); an existing one must be ours and writable only by us.

    Raises :class:`ServerError` naming the fix otherwise; an existing directory is never chmodded
    (it may be shared, or systemd's ``RuntimeDirectory=``, whose mode is the operator's choice).
    """
    try:
        path.mkdir(parents=True, mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
        return
    except FileExistsError:
        pass
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ServerError(f"{path} is not a directory")
    if info.st_uid != os.geteuid():
        raise ServerError(f"{path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()}); "
                          "remove it or choose another runtime_dir")
    if info.st_mode & 0o022:
        raise ServerError(f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}); "
                          f"run chmod 700 {path} or choose another runtime_dir")


def _socket_dir(path: Path) -> None:
    """The directory of an ``ipc://`` socket: created 0700 if missing, else used as it is unless
    anyone could replace our socket in it (group/world writable without the sticky bit)."""
    if not path.exists():
        secure_dir(path)
        return
    mode = os.stat(path).st_mode
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise ServerError(f"{path} is writable by other users without the sticky bit "
                          f"(mode {stat.S_IMODE(mode):o}): another user could replace the socket")


def lock_runtime_dir(runtime_dir: Path) -> int:
    """Hold ``daemon.lock`` in the runtime directory for the life of the process; return its fd."""
    secure_dir(runtime_dir)
    try:
        fd = os.open(runtime_dir / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ServerError(f"cannot open {runtime_dir / 'daemon.lock'}: {exc.strerror}") from None
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
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ set-up

    def bind(self) -> None:
        """Bind both sockets; ``tcp://...:0`` endpoints are replaced by the port actually bound."""
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self.pub_endpoint = self._bind(self._pub, self.pub_endpoint)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 2 * self._limit + 1024)
        self._router.setsockopt(zmq.RCVHWM, ROUTER_HWM)
        self._router.setsockopt(zmq.SNDHWM, ROUTER_HWM)
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
        _socket_dir(path.parent)
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
        served = 0
        while True:
            frames = await self._router.recv_multipart(copy=False)
            try:
                await self._serve_one(frames)
            except Exception as exc:  # a bug here must not end the loop (and the daemon with it)
                self._log_once("serving a request failed", exc)
            served += 1
            if served % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a flood must not starve heartbeats and housekeeping

    async def _serve_one(self, frames: list[zmq.Frame]) -> None:
        reply_to, body = _envelope([f.bytes for f in frames])
        if reply_to is None:
            log.debug("dropped a message without a routable envelope (%d frames)", len(frames))
            return
        peer = Peer.of(frames[-1])
        if peer.uid is None and ipc_path(self.request_endpoint) is not None:
            self._log_once("no peer credentials on ipc://", ServerError(
                "this libzmq does not report SO_PEERCRED; registrations will not be signalled"))
        token = current_peer.set(peer)
        try:
            reply = await self._answer(body)
        finally:
            current_peer.reset(token)
        with contextlib.suppress(zmq.ZMQError):
            await self._router.send_multipart([*reply_to, self._encode(reply)], flags=zmq.NOBLOCK)

    def _encode(self, reply: Reply) -> bytes:
        """The reply's bytes; one that cannot be encoded (a non-UTF-8 path) becomes an error reply."""
        try:
            return encode(reply)
        except Exception as exc:
            self._log_once("encoding a reply failed", exc)
            return encode(Reply(ok=False, error="internal error: the reply could not be encoded; "
                                                "see the daemon's log"))

    def _log_once(self, what: str, exc: BaseException) -> None:
        """Log a failure with its traceback the first time its cause is seen, at debug after that."""
        cause = f"{what}: {type(exc).__name__}: {str(exc)[:200]}"
        if cause in self._logged or len(self._logged) >= 1000:
            log.debug("%s", cause)
            return
        self._logged.add(cause)
        log.error("%s (logged once)", cause, exc_info=exc)

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
            self._log_once("undecodable request", exc)
            self._observe("invalid", False)
            return Reply(ok=False, error="invalid message")
        try:
            reply = await self._handler(request)
        except Exception as exc:
            self._log_once(f"handling a {request.type} request failed", exc)
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
