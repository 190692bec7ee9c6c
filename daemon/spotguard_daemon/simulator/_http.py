"""The HTTP side: a threading server, one handler thread per connection, faults applied on the wire.

Requests under ``/_sim/`` go to the control API; every other request is a metadata request: it is
counted, then either answered by the platform or misbehaves as the oldest live fault says. The
server speaks HTTP/1.1 with keep-alive like the real metadata services; it tracks its open
connections so :meth:`SimServer.close_connections` can end idle keep-alives and hanging requests at
once when the simulator stops.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit

from ._faults import Fault, FaultBook
from ._platform import PlatformSim, Request, Response

__all__ = ["SimServer", "MAX_BODY_BYTES"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
_GARBAGE = b"\x00\xff<html><body>\xfe\xfdnot what you asked for {{{ ]]"


class _Sim(Protocol):
    platform: PlatformSim
    faults: FaultBook

    def count(self, req: Request, faulted: bool) -> None: ...

    def control(self, req: Request) -> Response: ...


class SimServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    """socketserver's default backlog is 5: with the accepting thread starved (a loaded machine, the
    GIL shared with the client in one process) further connects lost their SYN and waited 1 s for
    its retry, past a 0.3-0.5 s request timeout (CI saw ConnectTimeout on loopback)."""

    def __init__(self, address: tuple[str, int], sim: _Sim) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.sim = sim
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer (or a stop) is routine here: log, do not print."""
        logger.debug("simulator: connection from %s ended with an error", client_address, exc_info=True)

    def track(self, conn: socket.socket, add: bool) -> None:
        with self._conn_lock:
            (self._connections.add if add else self._connections.discard)(conn)

    def close_connections(self) -> None:
        """Shut down every open connection (wakes handler threads blocked reading a keep-alive)."""
        with self._conn_lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 120  # an idle keep-alive connection is dropped after this many seconds
    server: SimServer

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; without NODELAY, Nagle plus delayed ACK adds
        # ~40 ms to every answer, which would swamp the notice latency the benchmarks measure.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def version_string(self) -> str:
        return self.server.sim.platform.server_header

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        logger.debug("simulator %s: " + format, self.server.sim.platform.name, *args)

    def do_GET(self) -> None:
        self._dispatch()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_GET

    def _dispatch(self) -> None:
        req = self._read_request()
        if req is None:
            return
        sim = self.server.sim
        if req.path.startswith("/_sim/"):
            self._send(sim.control(req))
            return
        fault = sim.faults.take()
        sim.count(req, faulted=fault is not None)
        if fault is None:
            self._send(sim.platform.handle(req))
        else:
            self._misbehave(fault, req)

    def _read_request(self) -> Request | None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES or length < 0:
            self._send(Response.text(413, "request body too large\n"))
            self.close_connection = True
            return None
        body = self.rfile.read(length) if length else b""
        split = urlsplit(self.path)
        query = {}
        for key, value in parse_qsl(split.query, keep_blank_values=True):
            query.setdefault(key, value)
        return Request(self.command, split.path, query, self.headers, body)

    def _send(self, resp: Response, declared_length: int | None = None) -> None:
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.content_type)
        self.send_header("Content-Length", str(len(resp.body) if declared_length is None else declared_length))
        for name, value in resp.headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(resp.body)

    # ------------------------------------------------------------ faults

    def _misbehave(self, fault: Fault, req: Request) -> None:
        sim = self.server.sim
        mode = fault.mode
        if mode.isdigit():
            extra = {"Retry-After": "1"} if mode == "429" else {}
            self._send(Response.text(int(mode), f"simulated {mode}\n", **extra))
        elif mode == "slow":
            sim.platform.wait(lambda: False, fault.delay)
            self._send(sim.platform.handle(req))
        elif mode == "garbage":
            self._send(Response(200, _GARBAGE, "text/plain"))
        elif mode == "truncated":
            real = sim.platform.handle(req)
            body = real.body or b"{"
            self._send(Response(real.status, body[: max(1, len(body) // 2)], real.content_type, real.headers),
                       declared_length=len(body) + 64)
            self._drop(reset=False)
        elif mode == "hang":
            sim.faults.hold(fault, lambda: sim.platform.stopping)
            self._drop(reset=False)
        else:  # reset
            self._drop(reset=True)

    def _drop(self, reset: bool) -> None:
        """Close the connection without (the rest of) an answer; with ``reset`` as a TCP RST."""
        self.close_connection = True
        try:
            self.wfile.flush()
            if reset:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                self.connection.shutdown(socket.SHUT_RDWR)
            self.connection.close()
        except OSError:
            pass
