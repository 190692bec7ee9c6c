"""A small HTTP reverse proxy for storage tests: counts request bytes and injects seeded faults.

Sits between a store's SDK and an emulator on 127.0.0.1. Every request is recorded as
``(method, path, body_bytes)``. With ``fault_rate > 0`` a seeded RNG picks requests to break:
``reset`` (connection reset before forwarding), ``reset_after`` (forwarded, then reset instead of the
reply: the server did it but the client cannot know), ``500``/``503`` (error reply, not forwarded),
``slow`` (forwarded after a delay); ``truncate`` (not among the defaults: forwarded, then the reply's
head with its full Content-Length and half its body, then the connection closed). At most
``max_faults`` faults are injected, so loops end.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

FAULTS = ("reset", "reset_after", "500", "503", "slow")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te", "trailer"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default 5 drops SYNs when eight uploads connect at once under load


class Proxy:
    def __init__(self, upstream: str, *, seed: int = 0, fault_rate: float = 0.0,
                 faults: tuple[str, ...] = FAULTS, max_faults: int = 1000, slow_s: float = 0.3,
                 host: str = "127.0.0.1") -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.fault_rate, self.faults, self.max_faults, self.slow_s = fault_rate, faults, max_faults, slow_s
        self.requests: list[tuple[str, str, int]] = []
        self.injected: list[tuple[str, str, str]] = []
        self.server = _Server((host, 0), _handler(self))
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def __enter__(self) -> "Proxy":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def pick_fault(self, method: str, path: str) -> str | None:
        with self.lock:
            if len(self.injected) >= self.max_faults or self.rng.random() >= self.fault_rate:
                return None
            fault = self.rng.choice(self.faults)
            self.injected.append((fault, method, path))
            return fault

    def rewrite(self, method: str, path: str, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The reply headers passed on to the client (subclasses play a lying server)."""
        return headers

    def bytes_sent_to(self, needle: str) -> int:
        """Request-body bytes of every request whose decoded path contains ``needle``."""
        with self.lock:
            return sum(n for _, path, n in self.requests if needle in unquote(path))

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _abort(self) -> None:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True

        def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                return reply.status, reply.getheaders(), reply.read()
            finally:
                conn.close()

        def _respond(self, status: int, headers: list[tuple[str, str]], data: bytes,
                     length: int | None = None) -> None:
            self.send_response(status)
            for key, value in headers:
                if key.lower() not in _HOP and (key.lower() != "content-length" or self.command == "HEAD"):
                    self.send_header(key, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _handle(self) -> None:
            body = self._body()
            with proxy.lock:
                proxy.requests.append((self.command, self.path, len(body)))
            fault = proxy.pick_fault(self.command, self.path)
            if fault == "reset":
                return self._abort()
            if fault in ("500", "503"):
                err = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                return self._respond(int(fault), [("Content-Type", "application/xml")], err)
            if fault == "slow":
                time.sleep(proxy.slow_s)
            status, headers, data = self._forward(body)
            if fault == "reset_after":
                return self._abort()
            if fault == "truncate" and len(data) > 1:
                self._respond(status, proxy.rewrite(self.command, self.path, headers), data[:len(data) // 2],
                              length=len(data))
                return self._abort()
            self._respond(status, proxy.rewrite(self.command, self.path, headers), data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

    return Handler
