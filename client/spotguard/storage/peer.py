"""The peer tier: a node's committed part, copied to a partner node's daemon and fetched back from it.

With node-local roots a node lost without notice takes its disk with it; the bucket lags the job by
an upload. A partner daemon that holds a verified copy of the node's newest committed parts lets the
relaunch resume from the step the node last committed locally (see docs/multi-node.md, "Three
tiers"). This module is the wire both sides speak, and the client the daemon pushes with and a
fresh node's leader fetches with; the server is ``spotguard_daemon.core.peer_server``.

HTTP, one request per file, under ``/v1/<job>/<slot>/``:

* ``GET  /v1/<job>/<slot>``                          the steps held: ``{"steps": [...]}``
* ``PUT  /v1/<job>/<slot>/<step>/files/<relpath>``   one file of the part (the body)
* ``POST /v1/<job>/<slot>/<step>/commit``            the part's ``manifest.json`` (the body): the
  server checks every file against it and only then makes the step visible
* ``GET  /v1/<job>/<slot>/<step>/manifest`` and ``.../files/<relpath>``: what a restore reads

``slot`` names the ranks whose parts a node holds (:func:`slot_of`): a fresh node that takes a lost
node's place runs the same ranks and asks for the same slot.

Trust: every request carries ``Authorization: Spotguard-HMAC ts=<unix>,mac=<hex>``, an HMAC-SHA256
of the method, the path and the time under the job's key (:func:`job_key`: derived from the
``peer.secret`` every node of the job shares, so one job's key does not open another's), refused
outside ``SKEW_S`` seconds. The manifest a node commits carries its own HMAC
(``X-Spotguard-Manifest-Mac``), made by the node that wrote the part and kept by the partner, so a
restore takes nothing the partner could have made up: the manifest must verify under the job's key,
and every file must match its size and sha256 in it. Nothing is unpickled; a restore writes bytes
under a private temporary directory and commits it as the checkpoint engine does.

Exceptions: :class:`PeerError` (refused, unreachable, or what came back does not verify).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import os
import re
import shutil
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from spotguard.storage._local import (
    MANIFEST,
    ManifestError,
    commit_dir,
    step_name,
    tmp_dir,
    validate_manifest,
)

__all__ = [
    "MAC_HEADER",
    "MAX_MANIFEST_BYTES",
    "SKEW_S",
    "PeerClient",
    "PeerError",
    "check_name",
    "check_relpath",
    "copy_hashed",
    "job_key",
    "manifest_mac",
    "newest_from_peers",
    "peers_from_env",
    "sign",
    "slot_of",
    "verify",
]

log = logging.getLogger(__name__)

SKEW_S = 300.0
"""How far a request's time may lie from the server's clock (a replay is refused after it)."""
MAC_HEADER = "X-Spotguard-Manifest-Mac"
MAX_MANIFEST_BYTES = 16 << 20
CHUNK = 1 << 20
FILES_AT_ONCE = 4
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


class PeerError(Exception):
    """A peer refused, could not be reached, or sent what does not verify."""


def check_name(value: str, what: str) -> str:
    """``value`` if it is a safe job or slot name (a letter or digit, then ``[A-Za-z0-9._-]``)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"invalid {what} {value!r}")
    return value


def check_relpath(rel: str) -> str:
    """``rel`` if it is a file path inside a part: at most 4 clean components, no ``..``."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not 1 <= len(parts) <= 4 or not all(_PART.fullmatch(p) and p not in (".", "..") for p in parts):
        raise ValueError(f"invalid file path {rel!r}")
    return rel


def slot_of(ranks: Iterable[int]) -> str:
    """The slot of a node holding ``ranks``: ``ranks-2-3``; a long list is named by its ends, its
    count and a hash, so the name stays short."""
    ranks = sorted(int(r) for r in ranks)
    if not ranks:
        raise ValueError("a slot needs at least one rank")
    if len(ranks) <= 16:
        return "ranks-" + "-".join(map(str, ranks))
    digest = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    return f"ranks-{ranks[0]}-{ranks[-1]}-n{len(ranks)}-{digest}"


def job_key(secret: str | bytes, job: str) -> bytes:
    """The job's key: HMAC-SHA256 of the job's name under the shared secret."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(raw, b"spotguard-peer\0" + job.encode(), hashlib.sha256).digest()


def _mac(key: bytes, method: str, path: str, ts: int) -> str:
    return hmac.new(key, f"{method}\n{path}\n{ts}".encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, now: float | None = None) -> str:
    """The ``Authorization`` header of a request."""
    ts = int(time.time() if now is None else now)
    return f"Spotguard-HMAC ts={ts},mac={_mac(key, method, path, ts)}"


def verify(key: bytes, method: str, path: str, header: str | None, now: float | None = None) -> bool:
    """Whether ``header`` authorises ``method path`` now."""
    match = re.fullmatch(r"Spotguard-HMAC ts=(\d{1,12}),mac=([0-9a-f]{64})", header or "")
    if match is None:
        return False
    ts = int(match.group(1))
    if abs((time.time() if now is None else now) - ts) > SKEW_S:
        return False
    return hmac.compare_digest(match.group(2), _mac(key, method, path, ts))


def manifest_mac(key: bytes, body: bytes) -> str:
    return hmac.new(key, b"manifest\0" + body, hashlib.sha256).hexdigest()


def peers_from_env(environ: Mapping[str, str] = os.environ) -> tuple[list[str], str | None]:
    """The partners' URLs and the secret from ``SPOTGUARD_PEER__PARTNERS`` (a JSON list or commas)
    and ``SPOTGUARD_PEER__SECRET``, the daemon's own settings; ``([], None)`` when unset."""
    raw = environ.get("SPOTGUARD_PEER__PARTNERS", "").strip()
    try:
        urls = json.loads(raw) if raw.startswith("[") else [u.strip() for u in raw.split(",") if u.strip()]
        if not isinstance(urls, list):
            raise ValueError("not a list")
    except ValueError as exc:  # the daemon refuses to start on it; training goes on without the tier
        log.warning("SPOTGUARD_PEER__PARTNERS is not a JSON list or URLs separated by commas (%s); "
                    "no partner is asked", exc)
        return [], None
    secret = environ.get("SPOTGUARD_PEER__SECRET") or None
    good = [str(u).rstrip("/") for u in urls if _is_http(u)]
    if len(good) != len(urls):
        log.warning("SPOTGUARD_PEER__PARTNERS: %d entries are not http:// URLs and are skipped",
                    len(urls) - len(good))
    return (good if secret else []), secret


def _is_http(url: Any) -> bool:
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    return parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)


class PeerClient:
    """Talks to one partner daemon's peer server at ``url`` for one job. Files go ``FILES_AT_ONCE``
    at a time, each over a connection of its own (``http.client``: the socket is read straight into
    one buffer per file, hashed and written with the GIL released)."""

    def __init__(self, url: str, secret: str | bytes, job: str, *, timeout: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise PeerError(f"{url!r} is not an http:// peer URL")
        self.url, self.job = url.rstrip("/"), check_name(job, "job id")
        self._scheme, self._netloc, self._timeout = parsed.scheme, parsed.netloc, timeout
        self._key = job_key(secret, job)

    def close(self) -> None:
        pass

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _path(self, slot: str, *rest: Any) -> str:
        return "/".join(["/v1", self.job, check_name(slot, "slot"), *map(str, rest)])

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return kind(self._netloc, timeout=self._timeout, blocksize=CHUNK)

    def _request(self, method: str, path: str, body: Any = None, headers: Mapping[str, str] | None = None,
                 read: Any = None) -> tuple[bytes, Mapping[str, str]]:
        """One request on a connection of its own; ``read(reply)`` consumes the body when given."""
        conn = self._connect()
        try:
            conn.request(method, path, body=body, headers={"Authorization": sign(self._key, method, path),
                                                           **(headers or {})})
            reply = conn.getresponse()
            if reply.status >= 300:
                raise PeerError(f"{self.url}: {method} {path}: HTTP {reply.status}: "
                                f"{reply.read(300).decode(errors='replace')}")
            return (read(reply) if read else reply.read(MAX_MANIFEST_BYTES + 1)), reply.headers
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(f"{self.url}: {method} {path}: {type(exc).__name__}: {exc}") from None
        finally:
            conn.close()

    def steps(self, slot: str) -> list[int]:
        """The steps the partner holds for ``slot``, oldest first."""
        try:
            body = json.loads(self._request("GET", self._path(slot))[0])
        except ValueError:
            raise PeerError(f"{self.url}: a malformed step list") from None
        steps = body.get("steps") if isinstance(body, dict) else None
        if not isinstance(steps, list) or not all(type(s) is int and 0 <= s < 10**10 for s in steps):
            raise PeerError(f"{self.url}: a malformed step list")
        return sorted(steps)

    def push(self, slot: str, step: int, part: Path) -> int:
        """Send the committed part ``part`` (its ``manifest.json`` and every file it lists) and
        commit it on the partner; returns the bytes sent."""
        body = (part / MANIFEST).read_bytes()
        files = sorted(json.loads(body)["files"].items())

        def send(item: tuple[str, Mapping[str, Any]]) -> int:
            rel, meta = item
            with open(part / rel, "rb") as data:
                self._request("PUT", self._path(slot, step, "files", check_relpath(rel)), body=data,
                              headers={"Content-Length": str(meta["size"])})
            return meta["size"]

        sent = sum(_each(send, files))
        self._request("POST", self._path(slot, step, "commit"), body=body,
                      headers={MAC_HEADER: manifest_mac(self._key, body), "Content-Length": str(len(body))})
        return sent

    def fetch(self, slot: str, step: int, root: Path) -> Path:
        """Restore the partner's copy of ``slot``'s ``step`` into ``root`` as ``step-N`` (every file
        checked against the manifest, whose HMAC is checked first); returns the directory."""
        body, headers = self._request("GET", self._path(slot, step, "manifest"))
        if len(body) > MAX_MANIFEST_BYTES or not hmac.compare_digest(
                headers.get(MAC_HEADER, ""), manifest_mac(self._key, body)):
            raise PeerError(f"{self.url}: the manifest of {slot} step {step} does not verify under the job's key")
        try:
            manifest = validate_manifest(json.loads(body), f"{self.url} {slot} step {step}")
        except (ValueError, ManifestError) as exc:
            raise PeerError(str(exc)) from None
        if manifest["step"] != step:
            raise PeerError(f"{self.url}: asked for step {step}, the manifest says {manifest['step']}")
        need = sum(meta["size"] for meta in manifest["files"].values())
        if need > shutil.disk_usage(root).free:
            raise PeerError(f"{self.url}: step {step} of {slot} is {need} bytes, more than {root} has free")
        tmp = tmp_dir(root, step)
        try:
            for rel in manifest["files"]:
                (tmp / check_relpath(rel)).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            _each(lambda item: self._fetch_file(slot, step, item[0], item[1], tmp), manifest["files"].items())
            (tmp / MANIFEST).write_bytes(body)
            return commit_dir(tmp, root, step_name(step))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _fetch_file(self, slot: str, step: int, rel: str, meta: Mapping[str, Any], tmp: Path) -> None:
        def receive(reply: http.client.HTTPResponse) -> bytes:
            length = reply.length
            if length is None or length != meta["size"]:
                raise PeerError(f"{self.url}: {rel} is {length} bytes, its manifest says {meta['size']}")
            with open(tmp / rel, "xb", buffering=0, opener=_private) as out:
                digest, short = copy_hashed(reply, out.fileno(), length)
                os.fsync(out.fileno())  # here, beside the other files' transfers, not all at the commit
            if short:
                raise PeerError(f"{self.url}: {rel} ended {short} bytes short")
            if digest != meta["sha256"]:
                raise PeerError(f"{self.url}: {rel} of {slot} step {step} does not match its manifest "
                                f"(sha256 {digest[:12]}...)")
            return b""

        self._request("GET", self._path(slot, step, "files", rel), read=receive)


def _each(fn: Any, items: Iterable[Any]) -> list[Any]:
    """``fn`` over ``items``, ``FILES_AT_ONCE`` at a time; the first error is raised."""
    with ThreadPoolExecutor(FILES_AT_ONCE, thread_name_prefix="spotguard-peer") as pool:
        return list(pool.map(fn, items))


def copy_hashed(source: Any, fd: int, length: int) -> tuple[str, int]:
    """Copy ``length`` bytes from ``source`` (``readinto``) to ``fd`` through one buffer, hashing
    them on the way; returns the sha256 and how many bytes short ``source`` ended (0: all)."""
    sha, buf = hashlib.sha256(), bytearray(min(max(length, 1), CHUNK))
    view = memoryview(buf)
    while length:
        got = source.readinto(view[: min(len(buf), length)])
        if not got:
            break
        sha.update(view[:got])
        data = view[:got]
        while data:  # a raw write may write fewer bytes than asked
            data = data[os.write(fd, data):]
        length -= got
    return sha.hexdigest(), length


def _private(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)


def newest_from_peers(urls: Sequence[str], secret: str, job: str, slot: str,
                      timeout: float = 10.0) -> dict[int, str]:
    """``{step: url}`` of every step some partner holds for ``slot`` (the newest listing wins);
    a partner that cannot be asked is logged and skipped."""
    held: dict[int, str] = {}
    for url in urls:
        try:
            with PeerClient(url, secret, job, timeout=timeout) as client:
                for step in client.steps(slot):
                    held.setdefault(step, url)
        except PeerError as exc:
            log.warning("cannot ask the peer %s which steps of %s it holds: %s", url, slot, exc)
    return held
