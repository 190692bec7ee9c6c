"""A tiny daemon for client tests: real ZeroMQ PUB and ROUTER sockets, answered by a thread.

It speaks the wire protocol of :mod:`spotguard.protocol` (the real daemon's server is tested on its
own); it records every request it got, keeps a list of pending notices for ``status``, and
publishes heartbeats every ``interval`` seconds while running.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import zmq

from spotguard.protocol import (
    CancelEvent,
    HeartbeatEvent,
    Notice,
    NoticeEvent,
    Reply,
    decode_request,
    encode,
    utcnow,
)


def make_notice(seconds: float | None = 30.0, *, terminating: bool = True, kind: str = "preempt",
                notice_id: str | None = None) -> Notice:
    deadline = None if seconds is None else utcnow() + timedelta(seconds=seconds)
    return Notice(id=notice_id or f"test:{uuid.uuid4().hex[:8]}", platform="test", kind=kind,
                  deadline=deadline, terminating=terminating, source="test")


class FakeDaemon:
    def __init__(self, runtime: Path, interval: float = 0.1) -> None:
        runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.pub_endpoint = f"ipc://{runtime}/events.sock"
        self.request_endpoint = f"ipc://{runtime}/requests.sock"
        self.interval = interval
        self.requests: list = []
        self.pending: list[Notice] = []
        self.daemon_id = uuid.uuid4().hex
        self._thread: threading.Thread | None = None

    def start(self) -> "FakeDaemon":
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(self.pub_endpoint)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.bind(self.request_endpoint)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(5)
        self._thread = None
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()

    def restart(self) -> None:
        self.stop()
        self.daemon_id = uuid.uuid4().hex
        self.start()

    def publish_notice(self, notice: Notice) -> None:
        self.pending.append(notice)
        self._send(b"notice", NoticeEvent(notice=notice))

    def publish_cancel(self, notice_id: str) -> None:
        self.pending = [n for n in self.pending if n.id != notice_id]
        self._send(b"cancel", CancelEvent(id=notice_id, reason="test"))

    def requests_of(self, kind: str) -> list:
        return [r for r in list(self.requests) if r.type == kind]

    def _send(self, topic: bytes, event) -> None:
        with self._lock:
            self._pub.send_multipart([topic, encode(event)])

    def _serve(self) -> None:
        seq, next_beat = 0, 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_beat:
                seq += 1
                self._send(b"heartbeat", HeartbeatEvent(seq=seq, daemon_id=self.daemon_id,
                                                        pending=[n.id for n in self.pending],
                                                        interval=self.interval))
                next_beat = time.monotonic() + self.interval
            if self._router.poll(20):
                *envelope, body = self._router.recv_multipart()
                self._router.send_multipart([*envelope, encode(self._answer(body))])

    def _answer(self, body: bytes) -> Reply:
        request = decode_request(body)
        self.requests.append(request)
        if request.type == "status":
            return Reply(ok=True, data={"daemon_id": self.daemon_id,  # as the real daemon's status
                                        "notices": [n.model_dump(mode="json") for n in self.pending]})
        return Reply(ok=True)


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
