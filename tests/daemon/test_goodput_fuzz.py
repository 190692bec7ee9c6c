"""Fuzzing what the goodput figures are read from: the ``progress``/``register``/``commit`` wire
fields of a real daemon, the ``progress.json`` objects it reads from its store (``file://``), and
the state files (``goodput.json``, ``timelines.json``) read by the real classes. The one invariant:
the daemon keeps answering and pinging systemd's watchdog, and no counter leaves its bounds (its
notify socket is read only at the end: a full queue must not stall the daemon, as it once did).
Bounded in time (a few hundred examples, a few seconds each part)."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spotguard.protocol import MAX_MTBF, CadenceRequest, StatusRequest, decode_reply, encode
from spotguard_daemon.core.goodput import MAX_INTERRUPTIONS, MAX_RUNNING, GoodputLedger
from spotguard_daemon.core.job_rates import JobRates
from spotguard_daemon.core.timeline import Timelines

from _runs import Runs
from test_goodput_bounds import notify, pings  # noqa: F401 - notify is a fixture

JOBS = ["a", "b", "c"]
numbers = st.one_of(st.integers(), st.integers(-2, 2**64), st.floats(), st.just(2**53), st.just(-1),
                    st.booleans(), st.none(), st.text(max_size=8))
stamps = st.one_of(st.floats(allow_nan=True), st.integers(-10, 2**40),
                   st.timedeltas(timedelta(days=-40), timedelta(days=2)).map(lambda d: time.time() + d.total_seconds()))
wire = st.fixed_dictionaries(
    {"type": st.sampled_from(["register", "progress", "commit", "cadence"]), "job_id": st.sampled_from(JOBS)},
    optional={"step": numbers, "resumed_from_step": numbers, "nodes": numbers, "rank": st.sampled_from([0, 1]),
              "at": st.one_of(numbers, st.datetimes(timezones=st.just(timezone.utc)).map(datetime.isoformat)),
              "reached_at": st.datetimes(timezones=st.just(timezone.utc)).map(datetime.isoformat),
              "save_seconds": numbers})
stored = st.fixed_dictionaries(
    {"version": st.sampled_from([1, 2, 3]), "job": st.sampled_from(JOBS), "step": numbers, "at": stamps,
     "written": stamps},
    optional={"reached": st.lists(st.tuples(numbers, stamps), max_size=20), "interruptions": numbers,
              "running": numbers, "nodes": numbers, "ran": numbers, "extra": numbers})


def check_bounds(daemon) -> None:
    for job in JOBS:
        rate = daemon.request(CadenceRequest(job_id=job)).data["rate"]
        if rate is not None:
            assert 0 <= rate["interruptions"] <= MAX_INTERRUPTIONS and 0 <= rate["running_s"] <= MAX_MTBF


@pytest.mark.timeout(180)
def test_fuzzed_wire_fields_and_store_objects_leave_the_daemon_answering_and_bounded(
        daemon_factory, tmp_path, sock_dir, notify):  # noqa: F811
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}", "SPOTGUARD_DELIVERY__SIGNAL": "none",
                                 "NOTIFY_SOCKET": str(sock_dir / "notify.sock"), "WATCHDOG_USEC": "200000"})
    runs = Runs()
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.request_endpoint)

    def send(raw: bytes) -> None:
        sock.send(raw)
        began = time.monotonic()
        ok = sock.poll(30000)
        import sys
        if time.monotonic() - began > 1:
            print(f"SLOW {time.monotonic() - began:.1f}s {raw[:200]!r}", file=sys.stderr)
        assert ok, f"the daemon stopped answering, after {raw[:300]!r}: {daemon.output()[-3000:]}"
        decode_reply(sock.recv())

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(wire, min_size=1, max_size=6), st.one_of(st.none(), stored), st.booleans())
    def play(messages, planted, restart):
        pid = runs.next() if restart else os.getpid()
        for message in messages:
            send(json.dumps({**message, "pid": pid, "path": str(daemon.checkpoint_root / "x")},
                            default=str).encode())
        if planted is not None:
            (bucket / "jobs" / planted["job"]).mkdir(parents=True, exist_ok=True)
            (bucket / "jobs" / planted["job"] / "progress.json").write_text(json.dumps(planted, default=str))
            send(json.dumps({"type": "register", "pid": runs.next(), "job_id": planted["job"],
                             "resumed_from_step": 1}).encode())

    try:
        play()
        send(encode(StatusRequest()))
        time.sleep(0.5)  # the recalls queued last are adopted by the next housekeeping passes
        check_bounds(daemon)
        assert pings(notify, 1.0) >= 3
    finally:
        runs.end()
        sock.close()
        ctx.term()
    assert "housekeeping" not in daemon.output() and "Traceback" not in daemon.output()


state_items = st.fixed_dictionaries(
    {"job": st.one_of(st.sampled_from(JOBS), numbers), "step": numbers, "at": stamps, "reached": st.one_of(
        st.lists(st.tuples(numbers, stamps), max_size=20), numbers)},
    optional={"pid": numbers, "interruptions": numbers, "running": numbers, "nodes": numbers, "drilled": numbers,
              "ran": numbers, "adopted": numbers})


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.one_of(st.fixed_dictionaries({"version": st.sampled_from([1, 2]), "jobs": st.lists(state_items, max_size=8)}),
                 st.binary(max_size=64).map(lambda b: b.decode("latin-1"))),
       st.one_of(st.fixed_dictionaries({"version": st.just(1), "alive_at": st.one_of(st.none(), st.text(max_size=30)),
                                        "open": st.lists(st.dictionaries(st.text(max_size=8), numbers, max_size=6),
                                                         max_size=3),
                                        "history": st.lists(st.dictionaries(st.text(max_size=8), numbers,
                                                                            max_size=6), max_size=3)}),
                 st.text(max_size=40)))
def test_fuzzed_state_files_load_to_bounded_figures_or_are_ignored(tmp_path_factory, goodput, timelines):
    where = tmp_path_factory.mktemp("state")
    (where / "goodput.json").write_text(json.dumps(goodput, default=str) if isinstance(goodput, dict) else goodput)
    ledger = GoodputLedger(where / "goodput.json")
    rates = JobRates(ledger, platform="aws")
    rates.snapshot()
    for job, record in ledger.recent(100):
        assert 0 <= record.interruptions <= MAX_INTERRUPTIONS and 0 <= record.running <= MAX_RUNNING
        rate = rates.rate(job)
        assert 0 <= rate.interruptions <= MAX_INTERRUPTIONS
    (where / "timelines.json").write_text(json.dumps(timelines, default=str) if isinstance(timelines, dict)
                                          else timelines)
    lines = Timelines(where / "timelines.json")
    lines.restore(set())
    lines.current()
    lines.history(10)
    lines.tick()
