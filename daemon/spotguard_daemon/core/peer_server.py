"""The peer server: holds the committed parts partner nodes push here, and serves them back.

The wire is :mod:`spotguard.storage.peer`'s. Parts live on disk under ``<state_dir>/peer/<job>/<slot>/``
as ``step-N/`` directories laid out as the sending node's checkpoint root held them (its
``manifest.json``, the manifest's HMAC in ``.mac``, the files), the newest ``peer.keep`` per slot. Disk,
not memory: a replica must survive the partner's daemon restarting, and a node's page cache serves
a fresh node's restore about as fast as memory would.

Rules:

* every request is authenticated under the job's key (:func:`spotguard.storage.peer.verify`); a
  write is accepted only for a job that has a client registered with this daemon (``jobs()``): a
  partner runs the same job, so a daemon never stores parts of a job it was not told about;
* names are checked (job, slot, step, file path: no ``..``, at most 4 components), files are created
  ``O_EXCL|O_NOFOLLOW`` inside private directories this server made, and a file longer than its
  ``Content-Length`` or one that would leave less than ``MIN_FREE_BYTES`` on the disk is refused;
* a step becomes visible only at its commit, once every file the manifest names is there with its
  size and sha256, and the manifest's HMAC verifies: a half-pushed part is never served;
* at most ``MAX_REQUESTS`` requests are served at once (503 beyond), each socket times out after
  ``peer.timeout`` seconds, and no request can stop the daemon (each runs in its own thread and any
  error is answered 500 and logged);
* the serving threads run at ``storage.upload_nice`` (Linux, per thread): receiving and hashing a
  partner's part is background work that yields to this node's own training, like an upload.

Exceptions: ``OSError`` from :meth:`PeerServer.start` when the address cannot be bound.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from spotguard._priority import lower_priority
from spotguard.storage._local import (
    MANIFEST,
    MAX_FILE_BYTES,
    ManifestError,
    step_name,
    validate_manifest,
)
from spotguard.storage.file import make_private_dirs
from spotguard.storage.peer import (
    MAC_HEADER,
    MAX_MANIFEST_BYTES,
    check_name,
    check_relpath,
    copy_hashed,
    job_key,
    manifest_mac,
    verify,
)

__all__ = ["MAX_REQUESTS", "MIN_FREE_BYTES", "PeerServer"]

log = logging.getLogger(__name__)

MAX_REQUESTS = 16
MAX_CONNECTIONS = 64
"""Open connections beyond this are closed at once: an idle flood cannot grow threads without bound."""
MIN_FREE_BYTES = 1 << 30
"""A push that would leave less free space than this on the state directory's disk is refused."""
_ROUTE = re.compile(r"/v1/([^/]+)/([^/]+)(?:/(\d{1,10})/(commit|manifest|files/(.+)))?")
MAC_FILE = ".mac"
INCOMING = ".incoming-"


def _manifest_of(step_dir: Path) -> bytes | None:
    """The manifest a held step's directory holds, or None."""
    try:
        return (step_dir / MANIFEST).read_bytes()
    except OSError:
        return None


class _Refused(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class PeerServer:
    """Serves ``root`` on ``host:port`` in threads; ``jobs()`` names the jobs writes are accepted for."""

    def __init__(self, root: Path, secret: str, *, keep: int, timeout: float,
                 jobs: Callable[[], set[str]], nice: int | None = None) -> None:
        self.root, self.keep, self.jobs = root, keep, jobs
        self._secret, self._timeout, self._nice = secret, timeout, nice
        self._slots = threading.BoundedSemaphore(MAX_REQUESTS)
        self._lock = threading.Lock()  # commits and retention of one daemon, one at a time
        self._received: dict[tuple[str, str, int, str], tuple[int, str]] = {}
        self._httpd: ThreadingHTTPServer | None = None
        self.address: tuple[str, int] | None = None

    def start(self, host: str, port: int) -> tuple[str, int]:
        make_private_dirs(self.root)
        os.chmod(self.root, 0o700)
        server = self

        class Handler(_Handler):
            peer = server
            timeout = self._timeout

        self._httpd = _BoundedServer((host, port), Handler)
        self.address = self._httpd.server_address[:2]
        threading.Thread(target=self._serve, name="spotguard-peer-server", daemon=True).start()
        log.info("peer server on %s:%d holds partners' parts under %s (newest %d per node)",
                 *self.address, self.root, self.keep)
        return self.address

    def _serve(self) -> None:
        # Each request's thread is made by this one and inherits its niceness (Linux: per thread):
        # receiving and hashing a partner's part yields to this node's own training.
        lower_priority(self._nice)
        assert self._httpd is not None
        self._httpd.serve_forever(0.1)

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    # ------------------------------------------------------------------ what a request does

    def held(self, job: str, slot: str) -> list[int]:
        where = self.root / job / slot
        names = os.listdir(where) if where.is_dir() else []
        return sorted(int(n[5:]) for n in names if re.fullmatch(r"step-\d{10}", n))

    def incoming(self, job: str, slot: str, step: int) -> Path:
        path = self.root / job / slot / f"{INCOMING}{step_name(step)}"
        make_private_dirs(path)
        return path

    def receive(self, job: str, slot: str, step: int, rel: str, length: int, body) -> None:
        usage = shutil.disk_usage(self.root)
        if usage.free - length < MIN_FREE_BYTES:
            raise _Refused(507, f"{length} bytes would leave less than {MIN_FREE_BYTES} bytes free")
        dest = self.incoming(job, slot, step) / rel
        make_private_dirs(dest.parent)
        if dest.exists() or dest.is_symlink():
            dest.unlink()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb", buffering=0) as out:
            digest, short = copy_hashed(body, out.fileno(), length)
        if short:
            raise _Refused(400, f"{rel}: the body ended {short} bytes short")
        with self._lock:  # hashed on the way in: the commit does not read the part again
            self._received[(job, slot, step, rel)] = (length, digest)

    def commit(self, job: str, slot: str, step: int, body: bytes, mac: str) -> None:
        if not hmac.compare_digest(mac, manifest_mac(job_key(self._secret, job), body)):
            raise _Refused(403, "the manifest's HMAC does not verify under the job's key")
        try:
            manifest = validate_manifest(json.loads(body), f"{job}/{slot} step {step}")
        except (ValueError, ManifestError) as exc:
            raise _Refused(400, str(exc)) from None
        if manifest["step"] != step:
            raise _Refused(400, f"the manifest says step {manifest['step']}, not {step}")
        incoming = self.incoming(job, slot, step)
        with self._lock:
            got = {rel: self._received.pop((job, slot, step, rel), None) for rel in manifest["files"]}
            for key in [k for k in self._received if k[:3] == (job, slot, step)]:
                del self._received[key]  # sent, but not in the manifest: not kept
        for rel, meta in manifest["files"].items():
            check_relpath(rel)
            if got[rel] is None or not (incoming / rel).is_file():
                raise _Refused(400, f"{rel} was not sent")
            if got[rel] != (meta["size"], meta["sha256"]):
                raise _Refused(400, f"{rel} does not match its manifest entry")
        (incoming / MANIFEST).write_bytes(body)
        (incoming / MAC_FILE).write_text(mac)
        with self._lock:
            final = incoming.parent / step_name(step)
            if _manifest_of(final) == body:  # the same step again (a sender's retry): the held copy stays
                shutil.rmtree(incoming, ignore_errors=True)
            elif final.exists():  # other bytes for a held step: swapped by renames, never absent meanwhile
                replaced = incoming.parent / f"{INCOMING}replaced-{step_name(step)}"
                shutil.rmtree(replaced, ignore_errors=True)
                os.rename(final, replaced)
                os.rename(incoming, final)
                shutil.rmtree(replaced, ignore_errors=True)
            else:
                os.rename(incoming, final)
            for old in self.held(job, slot)[: -self.keep]:
                shutil.rmtree(incoming.parent / step_name(old), ignore_errors=True)
            for left in incoming.parent.glob(f"{INCOMING}step-*"):  # pushes a sender never finished
                if int(left.name.rsplit("-", 1)[1]) < step:
                    shutil.rmtree(left, ignore_errors=True)
        log.info("peer: holds step %d of job %r, %s (%d files, %d bytes)", step, job, slot,
                 len(manifest["files"]), sum(m["size"] for m in manifest["files"].values()))

    def step_dir(self, job: str, slot: str, step: int) -> Path:
        path = self.root / job / slot / step_name(step)
        if not (path / MANIFEST).is_file():
            raise _Refused(404, f"no step {step} of {job}/{slot} here")
        return path


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most :data:`MAX_CONNECTIONS` of them."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self._open = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._open.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._open.release()


class _Handler(BaseHTTPRequestHandler):
    peer: PeerServer
    protocol_version = "HTTP/1.1"
    server_version = "spotguard-peer"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("peer %s: " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        if not self.peer._slots.acquire(blocking=False):
            return self._reply(503, {"error": f"busy: {MAX_REQUESTS} requests in progress"}, close=True)
        try:
            self._route(method)
        except _Refused as exc:
            if exc.status >= 500 or exc.status == 403:
                log.warning("peer: refused %s %s from %s: %s", method, self.path[:200], self.client_address[0], exc)
            self._reply(exc.status, {"error": str(exc)}, close=True)
        except Exception as exc:
            log.exception("peer: %s %s failed", method, self.path[:200])
            self._reply(500, {"error": type(exc).__name__}, close=True)
        finally:
            self.peer._slots.release()

    def _route(self, method: str) -> None:
        match = _ROUTE.fullmatch(self.path)
        if match is None:
            raise _Refused(404, "no such path")
        job, slot, step, action, rel = match.groups()
        try:
            check_name(job, "job id"), check_name(slot, "slot")
            rel = check_relpath(rel) if rel is not None else None
        except ValueError as exc:
            raise _Refused(400, str(exc)) from None
        if not verify(job_key(self.peer._secret, job), method, self.path, self.headers.get("Authorization")):
            raise _Refused(403, "not signed with this job's key (or signed too long ago)")
        if method != "GET" and job not in self.peer.jobs():
            raise _Refused(403, f"job {job!r} has no client registered with this daemon")
        step = int(step) if step is not None else None
        if method == "GET" and step is None:
            return self._reply(200, {"steps": self.peer.held(job, slot)})
        if method == "PUT" and rel is not None and action.startswith("files/"):
            length = self._length(MAX_FILE_BYTES)
            self.peer.receive(job, slot, step, rel, length, self.rfile)
            return self._reply(200, {"ok": True})
        if method == "POST" and action == "commit":
            body = self.rfile.read(self._length(MAX_MANIFEST_BYTES))
            self.peer.commit(job, slot, step, body, self.headers.get(MAC_HEADER, ""))
            return self._reply(200, {"ok": True})
        if method == "GET" and action == "manifest":
            where = self.peer.step_dir(job, slot, step)
            return self._send_bytes((where / MANIFEST).read_bytes(), {MAC_HEADER: (where / MAC_FILE).read_text()})
        if method == "GET" and rel is not None:
            return self._send_file(self.peer.step_dir(job, slot, step) / rel)
        raise _Refused(405, f"{method} is not served here")

    def _length(self, limit: int) -> int:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise _Refused(411, "a Content-Length is required") from None
        if not 0 <= length <= limit:
            raise _Refused(413, f"{length} bytes is more than {limit}")
        return length

    def _reply(self, status: int, body: dict, close: bool = False) -> None:
        self._send_bytes(json.dumps(body).encode(), {"Content-Type": "application/json"}, status, close)

    def _send_bytes(self, data: bytes, headers: dict[str, str], status: int = 200, close: bool = False) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _send_file(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            raise _Refused(404, "no such file") from None
        with os.fdopen(fd, "rb") as data:
            size = os.fstat(fd).st_size
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            started = time.monotonic()
            sent = self.connection.sendfile(data)  # zero copy: the page cache straight to the socket
            log.debug("peer: sent %s (%d bytes) in %.2f s", path.name, sent, time.monotonic() - started)

