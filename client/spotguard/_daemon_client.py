"""The client's link to the local daemon: events over SUB, requests over one fresh REQ each.

:class:`DaemonLink` is driven by its owner's background thread (:meth:`DaemonLink.poll`); it never
starts a thread and never raises for a daemon that is absent, slow or restarting, because training
must go on whether or not a daemon runs beside it. What it tracks:

* **liveness**: the daemon is *alive* while heartbeats (or replies) keep arriving; after
  ``dead_after`` heartbeat intervals of silence it is *gone* (logged once per transition).
* **missed notices**: a heartbeat lists the pending notice ids; one this link never saw (published
  before the subscription took effect) makes it ask for ``status``.
* **reconnects**: ZeroMQ reconnects the SUB socket by itself when the daemon comes back on the same
  endpoint; a heartbeat from a ``daemon_id`` other than the one this process registered with (a
  restart, even one before any heartbeat of the first daemon arrived; the register's reply names
  it) or the first one after silence makes the link register
  again and ask for ``status``, so pending notices published while nobody listened (the ZeroMQ
  "slow joiner" gap) are still learnt. A register that failed is tried again on the next heartbeat.

An ``ipc://`` socket is used only in a directory that no other user could have made or can write
(:func:`spotguard._paths.untrusted`, checked before every request and before subscribing): a fake
daemon in another user's ``/tmp/spotguard-<uid>`` is refused with one error line, as no daemon.

Requests use a fresh REQ socket each (``linger=0``, short timeout): a REQ socket whose reply never
came is stuck in its state machine, and a fresh one costs microseconds. Requests are thread-safe
(the checkpointer's commit callback runs in its persist thread).

Exceptions: none escape; a failed request returns ``None`` and is logged at debug level.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import zmq

from spotguard import _paths
from spotguard.protocol import (
    HeartbeatEvent,
    Notice,
    NoticeEvent,
    ProtocolError,
    RegisterRequest,
    Reply,
    StatusRequest,
    UnregisterRequest,
    decode_event,
    decode_reply,
    encode,
)

__all__ = ["DaemonLink"]

log = logging.getLogger(__name__)

EventSink = Callable[[Any], None]
"""Receives each decoded event, and each pending notice learnt from ``status`` as a ``Notice``."""


class DaemonLink:
    """One process's connection to the daemon (see the module docstring for the contract)."""

    def __init__(
        self,
        sink: EventSink,
        *,
        job_id: str = "",
        rank: int = 0,
        pub_endpoint: str | None = None,
        request_endpoint: str | None = None,
        request_timeout: float = 0.5,
        dead_after: float = 3.0,
        signal: bool = True,
    ) -> None:
        self._sink = sink
        self._job_id, self._rank = job_id, rank
        self.signal = signal
        """Whether this process registers as handling the daemon's signal (see ``RegisterRequest``)."""
        self._request_endpoint = request_endpoint or _paths.request_endpoint()
        self._timeout_ms = max(1, int(request_timeout * 1000))
        self._dead_after = dead_after
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 1000)
        for topic in (b"notice", b"cancel", b"heartbeat", b"durable"):
            self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._pub_endpoint = pub_endpoint or _paths.pub_endpoint()
        self._attached = False
        self._distrust: str | None = None
        """Why the socket directory is not trusted (:func:`spotguard._paths.untrusted`), logged once."""
        self._lock = threading.Lock()
        self._daemon_id: str | None = None
        self._registered_with: str | None = None
        """The ``daemon_id`` of the daemon that accepted the newest register (None: unknown)."""
        self._last_seen = 0.0
        self._interval = 1.0
        self._alive = False
        self._closed = False
        self._seen: set[str] = set()
        """Ids of the notices passed to the sink; a heartbeat listing another one asks status."""
        self._refused: set[tuple[str, str]] = set()
        """(request type, error) already warned about: a refusal is loud once per cause."""
        self.registered: dict[str, Any] = {}
        """The data of the newest accepted ``register`` reply (``mtbf``: the daemon's node MTBF prior)."""
        self.signalled: dict[str, tuple[float, float | None]] = {}
        """From the newest ``status``: the notices the daemon recently signalled for, each with when
        it signalled and when the notice was cancelled (None: pending), in epoch seconds."""

    @property
    def alive(self) -> bool:
        """True while the daemon answers or sends heartbeats."""
        return self._alive

    def connect(self) -> bool:
        """Register this process and learn pending notices; False when no daemon answered.

        An ``ipc://`` endpoint whose socket file does not exist has no daemon: no request is sent,
        so a job without a daemon does not wait ``request_timeout`` at start-up.
        """
        if not self._attach():
            return False
        reply = self.request(RegisterRequest(pid=os.getpid(), rank=self._rank, job_id=self._job_id,
                                             signal=self.signal))
        if reply is None or not reply.ok:
            return False
        self.registered = reply.data
        status = self.refresh()
        # The daemon that took the register: its reply names it (an older daemon's does not, and
        # the status that follows does, unless that daemon restarted in between).
        self._registered_with = reply.data.get("daemon_id") or (
            status.data.get("daemon_id", self._daemon_id) if status is not None and status.ok else None)
        return True

    def refresh(self) -> Reply | None:
        """Ask ``status`` and pass its pending notices to the sink (e.g. the notice behind a
        signal that overtook its event); note the notices it recently signalled for. Returns the
        reply (None: none came)."""
        status = self.request(StatusRequest())
        if status is not None and status.ok:
            self.signalled = _signalled(status.data.get("signalled"))
        for notice in _pending_notices(status):
            self._seen.add(notice.id)
            self._sink(notice)
        return status

    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for events, pass them to the sink, update liveness."""
        if self._closed or not self._attach():
            time.sleep(timeout)
            return
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and self._sub.poll(int(left * 1000) + 1):
            self._receive_one()
        self._check_silence()

    def request(self, message: Any) -> Reply | None:
        """Send one request and wait briefly for its reply; None when none came or it was invalid."""
        if self._closed or not self._trusted():
            return None
        sock = self._ctx.socket(zmq.REQ)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._request_endpoint)
            sock.send(encode(message))
            if not sock.poll(self._timeout_ms):
                log.debug("daemon did not answer %s within %d ms", message.type, self._timeout_ms)
                return None
            reply = decode_reply(sock.recv())
        except (zmq.ZMQError, ProtocolError) as exc:
            log.debug("request %s failed: %s", message.type, exc)
            return None
        finally:
            sock.close(linger=0)
        self._mark_seen()
        if not reply.ok and (message.type, reply.error) not in self._refused and len(self._refused) < 100:
            self._refused.add((message.type, reply.error))
            log.warning("the daemon refused %s: %s", message.type, reply.error)
        return reply

    def close(self) -> None:
        """Unregister (best effort, when the daemon is alive) and release the sockets."""
        if self._closed:
            return
        if self._alive:
            self.request(UnregisterRequest(pid=os.getpid()))
        self._closed = True
        self._sub.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ internals

    def _trusted(self) -> bool:
        """Whether the sockets' directories may be trusted now; an error line once per cause
        when not (another user's ``/tmp/spotguard-<uid>`` may hold a fake daemon)."""
        why = _paths.untrusted(self._request_endpoint) or _paths.untrusted(self._pub_endpoint)
        if why and why != self._distrust:
            log.error("not talking to the daemon: %s", why)
        self._distrust = why
        return why is None

    def _attach(self) -> bool:
        """Subscribe once the daemon's socket exists in a trusted directory: ZeroMQ would connect
        by itself to whatever appears at the path later, whoever made it."""
        if not self._attached and not _absent(self._request_endpoint) and self._trusted():
            self._sub.connect(self._pub_endpoint)
            self._attached = True
        return self._attached

    def _receive_one(self) -> None:
        try:
            frames = self._sub.recv_multipart(zmq.NOBLOCK)
            event = decode_event(frames[-1])
        except zmq.Again:
            return
        except (ProtocolError, IndexError) as exc:
            log.warning("ignored an invalid event from the daemon: %s", exc)
            return
        if isinstance(event, HeartbeatEvent):
            self._on_heartbeat(event)
        else:
            self._mark_seen()
            if isinstance(event, NoticeEvent):
                self._seen.add(event.notice.id)
            self._sink(event)

    def _on_heartbeat(self, beat: HeartbeatEvent) -> None:
        self._interval = beat.interval
        known = self._daemon_id or self._registered_with  # a daemon killed before its first heartbeat came
        restarted = known is not None and beat.daemon_id != known
        rejoined = not self._alive
        self._daemon_id = beat.daemon_id
        self._mark_seen()
        if restarted:
            log.info("daemon restarted (id %s); registering again", beat.daemon_id)
        if rejoined or beat.daemon_id != self._registered_with:  # also retries a register that failed
            self.connect()
        elif not self._seen.issuperset(beat.pending):
            self.refresh()  # a notice published before our subscription took effect
        self._sink(beat)

    def _mark_seen(self) -> None:
        with self._lock:
            self._last_seen = time.monotonic()
            if not self._alive:
                log.info("daemon reachable at %s", self._request_endpoint)
            self._alive = True

    def _check_silence(self) -> None:
        with self._lock:
            silent = time.monotonic() - self._last_seen
            if self._alive and silent > max(self._dead_after * self._interval, 0.5):
                log.warning("daemon silent for %.1f s; training goes on, waiting for it", silent)
                self._alive = False


def _pending_notices(status: Reply | None) -> list[Notice]:
    """The notices in a ``status`` reply's ``data["notices"]``; invalid entries are skipped."""
    notices = []
    for raw in (status.data.get("notices") or []) if status is not None and status.ok else []:
        try:
            notices.append(Notice.model_validate(raw))
        except ValueError as exc:
            log.warning("ignored an invalid pending notice in status: %s", exc)
    return notices


def _signalled(raw: Any) -> dict[str, tuple[float, float | None]]:
    """``status``'s ``signalled`` (an older daemon sends none); malformed entries are skipped."""
    found = {}
    for notice_id, times in (raw if isinstance(raw, dict) else {}).items():
        try:
            cancelled = times.get("cancelled_at")
            found[str(notice_id)] = (float(times["at"]), None if cancelled is None else float(cancelled))
        except (AttributeError, KeyError, TypeError, ValueError):
            continue
    return found


def _absent(endpoint: str) -> bool:
    return endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://"):])
