"""A TCP fault proxy for storage tests: bytes between an SDK and an emulator, broken at the socket level.

Unlike :mod:`storage_proxy` (an HTTP proxy that answers whole requests), this one relays raw TCP on
127.0.0.1, so faults land where real networks put them: inside a body, inside a header, mid-upload.
``mode`` applies to connections opened while it is set, and ``reset``/``stall``/``truncate`` also to
pooled connections opened before (switch it to ``None`` to heal):

* ``reset``     relay, then RST the connection after ``reset_after`` reply bytes or 32 KiB of request
* ``503``       answer the first request head with ``503`` and close (the body is never read)
* ``trickle``   relay replies ``trickle_bytes`` at a time with ``trickle_s`` pauses
* ``stall``     read the request, never answer (the client's read timeout must fire)
* ``truncate``  relay ``truncate_after`` reply bytes, then close cleanly (FIN) mid-body

The event loop runs in a daemon thread; :meth:`close` stops it and every connection.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from urllib.parse import urlsplit

MODES = ("reset", "503", "trickle", "stall", "truncate")
_REPLY_503 = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class TcpFaultProxy:
    def __init__(self, upstream: str, *, reset_after: int = 300, truncate_after: int = 200,
                 trickle_bytes: int = 512, trickle_s: float = 0.02) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.mode: str | None = None
        self.reset_after, self.truncate_after = reset_after, truncate_after
        self.trickle_bytes, self.trickle_s = trickle_bytes, trickle_s
        self.connections = 0
        self.faulted = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        # A connection accepted as the server closed may have started after close()'s sweep: end
        # it here, on the open loop. Left for the garbage collector, it would run its finally
        # blocks on a closed loop ("Event loop is closed", failing whichever test collects it).
        left = asyncio.all_tasks(self.loop)
        for task in left:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self.loop.close()

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "TcpFaultProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mode = self.mode
        self.connections += 1
        self.faulted += mode is not None
        try:
            if mode == "503":
                await reader.readuntil(b"\r\n\r\n")
                writer.write(_REPLY_503)
                await writer.drain()
                return
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            try:
                await asyncio.gather(self._pump(reader, up_writer, mode, upload=True, client=writer),
                                     self._pump(up_reader, writer, mode, upload=False, client=writer))
            finally:
                up_writer.close()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, _Reset):
            pass
        finally:
            if not writer.transport.is_closing():
                writer.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, mode: str | None, *,
                    upload: bool, client: asyncio.StreamWriter) -> None:
        sent = 0
        while data := await src.read(self.trickle_bytes if mode == "trickle" else 65536):
            mode = self.mode if self.mode in ("reset", "stall", "truncate") else mode  # pooled connections too
            if mode == "stall" and not upload:
                await asyncio.sleep(3600)
            limit = {"reset": 32768 if upload else self.reset_after,
                     "truncate": None if upload else self.truncate_after}.get(mode or "")
            if limit is not None and sent + len(data) >= limit:
                dst.write(data[:max(0, limit - sent)])
                await dst.drain()
                if mode == "reset":
                    _abort(client)
                    raise _Reset
                client.close()
                return
            dst.write(data)
            await dst.drain()
            sent += len(data)
            if mode == "trickle" and not upload:
                await asyncio.sleep(self.trickle_s)
        if dst.can_write_eof():
            dst.write_eof()


class _Reset(Exception):
    pass


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a crashed middlebox or a dropped NAT entry does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
