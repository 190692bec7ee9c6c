"""Fuzzing the request socket of a real daemon: it answers or drops garbage and keeps serving.

Thousands of messages in all: random bytes, random JSON, known request types with wrong field
types, JSON nested deeper than the parser's recursion limit, oversized frames (some beyond
ZMQ_MAXMSGSIZE, which cuts the peer off), and multi-frame
messages with and without a routable envelope. After every batch a valid ``status`` must still be
answered. The daemon's signal delivery is off: a fuzzed ``register`` could name any pid.
"""

from __future__ import annotations

import json
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spotguard.protocol import StatusRequest, decode_reply

pytestmark = pytest.mark.slow

LIMIT = 4096
TYPES = ["register", "unregister", "status", "safe", "commit", "notify", "progress", "reply", "notice"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children,
                                                                       max_size=5),
    max_leaves=20)
wrong_typed = st.fixed_dictionaries(
    {"type": st.sampled_from(TYPES)},
    optional={"v": json_values, "pid": json_values, "notice_ids": json_values, "path": json_values,
              "step": json_values, "kind": json_values, "deadline_seconds": json_values,
              "rank": json_values, "at": json_values, "job_id": json_values}).map(lambda d: json.dumps(d).encode())
frames = st.one_of(
    st.binary(max_size=512),
    json_values.map(lambda v: json.dumps(v).encode()),
    wrong_typed,
    st.integers(LIMIT + 1, 4 * LIMIT).map(lambda n: b"{" * n),
    st.integers(500, LIMIT - 1).map(lambda n: b"[" * n),  # deeper than json's recursion limit
    st.integers(100, LIMIT // 5).map(lambda n: b'{"a":' * n),
)
messages = st.tuples(st.booleans(), st.lists(frames, min_size=1, max_size=4))


@pytest.fixture
def fuzz_daemon(daemon_factory):
    return daemon_factory(env={"SPOTGUARD_ZMQ__MAX_MESSAGE_BYTES": str(LIMIT),
                               "SPOTGUARD_DELIVERY__SIGNAL": "none"})


def drain_replies(dealer) -> int:
    """Read every reply waiting; each one must be a valid Reply. Returns how many."""
    count = 0
    while dealer.poll(0):
        reply = decode_reply(dealer.recv_multipart()[-1])
        assert reply.type == "reply"
        count += 1
    return count


@pytest.fixture
def dealer(fuzz_daemon):
    """One client context and one DEALER for all of a test's examples (the daemon cuts it off on an
    oversized frame; ZeroMQ reconnects it). A context per example (200 terminations in a row) once
    made libzmq abort the *test* process inside ``zmq_ctx_term`` (a libzmq assertion, as in
    zeromq/libzmq#1307), and a socket per example (200 closes, each racing a reconnect after a
    cut-off) aborted it once more under load; the daemon, which never closes its socket while
    serving, lived on both times."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(fuzz_daemon.request_endpoint)
        yield sock


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(messages, min_size=1, max_size=12))
def test_garbage_never_stops_the_request_loop(fuzz_daemon, dealer, batch):
    daemon = fuzz_daemon
    for with_envelope, parts in batch:
        dealer.send_multipart([b"", *parts] if with_envelope else parts)
    drain_replies(dealer)
    reply = daemon.request(StatusRequest(), timeout=5)
    assert reply.ok and reply.data["pid"] == daemon.proc.pid
    assert daemon.proc.poll() is None


def test_error_replies_name_the_problem_under_a_flood(fuzz_daemon):
    """A tight flood of 2000 malformed requests: each one enveloped gets an error reply."""
    daemon = fuzz_daemon
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.connect(daemon.request_endpoint)
        for i in range(2000):
            dealer.send_multipart([b"", b'{"type": "register", "pid": "x%d"}' % i])
        got, deadline = [], time.monotonic() + 20
        while len(got) < 2000 and time.monotonic() < deadline:
            if dealer.poll(1000):
                got.append(decode_reply(dealer.recv_multipart()[-1]))
        dealer.close(linger=0)
    assert len(got) == 2000
    assert all(not r.ok and "register.pid" in r.error for r in got)
    assert daemon.request(StatusRequest()).ok
