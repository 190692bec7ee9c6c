"""The daemon's learned MTBF per job: the ledger's interruptions and running time (kept across
restarts, the daemon's own restart and, through the store's object, other nodes), the estimate over
its prior (the setting or the platform's default, divided by the job's nodes), the gauges, and the
``progress`` and ``cadence`` replies of a real daemon."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError
from spotguard import cadence as cad
from spotguard.protocol import (CadenceRequest, JobRate, Kind, NotifyRequest, ProgressRequest, RegisterRequest,
                                SafeRequest, StatusRequest)
from spotguard_daemon.core.goodput import MAX_INTERRUPTIONS, GoodputLedger, JobRecord
from spotguard_daemon.core.goodput_store import VERSION, ProgressObject, _encode, _validated
from spotguard_daemon.core.job_rates import MAX_GAUGED, JobRates
from spotguard_daemon.core.settings import SettingsError, load_settings

from _runs import Runs
from test_goodput_fresh_node import wait_for
from test_goodput_ledger import Clock, at

HOUR = 3600.0


def run_for(ledger: GoodputLedger, clock: Clock, job: str, pid: int, seconds: float, step: int,
            nodes: int = 1) -> None:
    """Reports of ``pid`` across ``seconds`` (one at each end)."""
    ledger.progress(job, step, at(clock.now), pid, nodes=nodes)
    clock.now += seconds
    ledger.progress(job, step + 10, at(clock.now), pid, nodes=nodes)


def test_restarts_count_interruptions_and_keep_the_running_time_across_a_daemon_restart(tmp_path):
    clock = Clock()
    ledger = GoodputLedger(tmp_path / "goodput.json", clock=clock)
    run_for(ledger, clock, "j", 1, 100.0, 0)
    record = ledger.record("j")
    assert (record.interruptions, record.running) == (0, 100.0)
    clock.now += 30  # down: not running time
    ledger.restarted("j", 5, pid=2)
    clock.now += 50
    ledger.progress("j", 20, at(clock.now), 2)  # counted from the registration
    record = ledger.record("j")
    assert (record.interruptions, record.running) == (1, 150.0)
    ledger.flush(force=True)
    again = GoodputLedger(tmp_path / "goodput.json", clock=clock)
    again.restarted("j", 20, pid=3)
    assert (again.record("j").interruptions, again.record("j").running) == (2, 150.0)
    assert again.record("other") is None


def test_a_job_new_to_this_node_adopts_the_store_record_plus_the_restart_that_brought_it():
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    ledger.restarted("j", 7, pid=9)  # unknown here: the caller asks the store
    assert ledger.record("j").interruptions == 0
    clock.now += 10
    ledger.progress("j", 9, at(clock.now), 9)
    ledger.adopt("j", JobRecord(7, clock.now - 60, interruptions=4, running=3000.0, nodes=2))
    record = ledger.record("j")
    assert (record.interruptions, record.running, record.nodes) == (5, 3010.0, 2)
    ledger.adopt("gone", JobRecord(1, 1.0, interruptions=4))  # forgotten meanwhile: nothing to add to
    assert ledger.record("gone") is None


def test_the_store_object_carries_the_counts_and_older_objects_still_parse():
    now = time.time()
    record = JobRecord(12, now - 10, {10: now - 20}, pid=4, interruptions=3, running=7200.5, nodes=8)
    doc = json.loads(_encode("j", record))
    assert (doc["interruptions"], doc["running"], doc["nodes"]) == (3, 7200.5, 8)
    back = _validated(_encode("j", record), "j", before=doc["written"] + 1)
    assert (back.interruptions, back.running, back.nodes) == (3, 7200.5, 8)
    old = {k: v for k, v in doc.items() if k not in ("interruptions", "running", "nodes")}
    assert ProgressObject.model_validate(old).record().interruptions == 0
    for bad in ({"interruptions": -1}, {"running": -5}, {"running": float("inf")}, {"nodes": 0}):
        with pytest.raises(ValidationError):
            ProgressObject.model_validate({**doc, **bad})


def test_a_newer_daemons_object_is_read_for_the_known_fields_and_an_unknown_field_of_ours_refused():
    """Mixed fleets: a newer daemon adds fields and raises the version; this one reads what it
    knows. The same unknown field under this daemon's own version is not one of ours."""
    now = time.time()
    doc = json.loads(_encode("j", JobRecord(12, now - 10, {10: now - 20}, interruptions=3, running=60.0)))
    newer = json.dumps({**doc, "version": VERSION + 1, "preempted_by": "spot", "extra": {"a": [1]}}).encode()
    back = _validated(newer, "j", before=doc["written"] + 1)
    assert (back.step, back.interruptions, back.running) == (12, 3, 60.0)
    for bad in ({"preempted_by": "spot"}, {"version": VERSION + 1, "step": -1}):
        with pytest.raises(ValueError):
            _validated(json.dumps({**doc, **bad}).encode(), "j", before=doc["written"] + 1)
    with pytest.raises(ValueError):  # not JSON at all: pydantic's error, not the version path's
        _validated(b"[" * 10_000, "j", before=now)


def test_the_estimate_uses_the_setting_or_the_platform_default_divided_by_the_nodes():
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    run_for(ledger, clock, "solo", 1, 2 * HOUR, 0)
    run_for(ledger, clock, "wide", 2, 2 * HOUR, 0, nodes=4)
    set_prior = JobRates(ledger, platform="aws", node_mtbf_hours=8.0, min_mtbf_seconds=60)
    solo, wide = set_prior.rate("solo"), set_prior.rate("wide")
    assert solo.prior_mtbf_s == 8 * HOUR and solo.mtbf_s == pytest.approx(cad.learned_mtbf(8 * HOUR, 0, 2 * HOUR))
    assert wide.prior_mtbf_s == 2 * HOUR and wide.nodes == 4  # any of 4 nodes stops the job
    assert wide.mtbf_s == pytest.approx((2 * HOUR + 2 * HOUR) / 1)
    assert JobRates(ledger, platform="gcp").rate("solo").prior_mtbf_s == cad.NODE_MTBF_S["gcp"]
    assert JobRates(ledger, platform="none").rate("solo").prior_mtbf_s == cad.NODE_MTBF_S["none"]
    assert set_prior.rate("unknown") is None


def test_many_interruptions_in_little_time_stop_at_the_floor_and_huge_figures_stay_in_bounds():
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    ledger.progress("j", 0, at(clock.now), 1)
    for pid in range(2, 50):
        clock.now += 1
        ledger.restarted("j", 0, pid=pid)
        ledger.progress("j", 1, at(clock.now), pid)  # the run trained: its restart is an interruption
    rates = JobRates(ledger, platform="aws", node_mtbf_hours=1.0, min_mtbf_seconds=120)
    assert rates.rate("j").mtbf_s == 120 and rates.rate("j").interruptions == 48
    for pid in range(50, 60):  # runs that never trained: a register claim alone counts nothing
        ledger.restarted("j", 0, pid=pid)
    assert rates.rate("j").interruptions == 49
    ledger.record("j").running = 1e300  # a state file's figure: clamped into the protocol's bounds
    ledger.record("j").interruptions = 2**60
    back = JobRate.model_validate(rates.rate("j").model_dump())
    assert back.running_s < 1e300 and back.interruptions == MAX_INTERRUPTIONS


def test_gauges_cover_the_most_recent_jobs_only():
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    rates = JobRates(ledger, platform="aws", node_mtbf_hours=1.0)
    registry = CollectorRegistry()
    registry.register(rates)
    for i in range(MAX_GAUGED + 10):
        run_for(ledger, clock, f"job-{i}", i + 1, 10.0, 0)
    rates.snapshot()
    text = generate_latest(registry).decode()
    lines = [line for line in text.splitlines() if line.startswith("spotguard_job_mtbf_seconds{")]
    assert len(lines) == MAX_GAUGED
    assert f'job="job-{MAX_GAUGED + 9}"' in text and 'job="job-0"' not in text
    assert f'spotguard_job_interruptions{{job="job-{MAX_GAUGED + 9}"}} 0.0' in text


@pytest.mark.slow
def test_a_real_daemon_answers_progress_and_cadence_with_the_job_rate(daemon_factory):
    daemon = daemon_factory(env={"SPOTGUARD_CADENCE__NODE_MTBF_HOURS": "2",
                                 "SPOTGUARD_CADENCE__MIN_MTBF_SECONDS": "30"})
    runs = Runs()
    try:
        pid = runs.next()
        assert daemon.request(RegisterRequest(pid=pid, job_id="r")).ok
        reply = daemon.request(ProgressRequest(pid=pid, job_id="r", step=1, at=datetime.now(timezone.utc),
                                               nodes=2))
        rate = JobRate.model_validate(reply.data["rate"])
        assert rate.prior_mtbf_s == HOUR and rate.nodes == 2 and rate.interruptions == 0 and rate.floor_s == 30
        assert daemon.request(RegisterRequest(pid=runs.next(), job_id="r", resumed_from_step=1)).ok
    finally:
        runs.end()
    known = JobRate.model_validate(daemon.request(CadenceRequest(job_id="r")).data["rate"])
    assert known.interruptions == 1 and known.mtbf_s == pytest.approx(cad.learned_mtbf(HOUR, 1, known.running_s))
    assert daemon.request(CadenceRequest(job_id="nobody")).data == {"rate": None, "durable_s": None}
    url = daemon.request(StatusRequest()).data["metrics"]
    wait_for(lambda: 'spotguard_job_interruptions{job="r"} 1.0' in httpx.get(url, timeout=5).text,
             "the gauge (a snapshot taken every housekeeping round)", 10)


@pytest.mark.parametrize("name, value", [("PRIOR_WEIGHT", "0"), ("NODE_MTBF_HOURS", "-1"),
                                         ("MIN_MTBF_SECONDS", "nan")])
def test_bad_cadence_settings_are_refused_in_one_line(monkeypatch, name, value):
    monkeypatch.setenv(f"SPOTGUARD_CADENCE__{name}", value)
    with pytest.raises(SettingsError, match=f"cadence.{name.lower()}"):
        load_settings(None)


def test_cadence_command_with_job_refuses_other_mtbf_sources_and_says_when_no_daemon_answers(tmp_path,
                                                                                             monkeypatch):
    from click.testing import CliRunner
    from spotguard_daemon.commands.cadence import cadence as command

    for key in [k for k in os.environ if k.startswith("SPOTGUARD_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SPOTGUARD_RUNTIME_DIR", str(tmp_path / "run"))
    both = CliRunner().invoke(command, ["--checkpoint-seconds", "30", "--job", "j", "--nodes", "2"])
    assert both.exit_code == 2 and "not both" in both.output
    none = CliRunner().invoke(command, ["--checkpoint-seconds", "30", "--job", "j"])
    assert none.exit_code == 1 and "no daemon answered" in none.output


@pytest.mark.slow
def test_a_restart_after_a_drill_is_no_interruption_one_after_a_preemption_is(daemon_factory):
    daemon = daemon_factory()
    runs = Runs()  # each run a process of its own: the notices' SIGUSR1 ends it, as a stop would
    try:
        _drill_then_preempt(daemon, runs)
    finally:
        runs.end()


def _drill_then_preempt(daemon, runs: Runs) -> None:
    pid = runs.next()

    def stop_and_resume(kind: Kind, step: int) -> int:
        nonlocal pid
        notice = daemon.request(NotifyRequest(kind=kind, deadline_seconds=30)).data["notice"]["id"]
        assert daemon.request(SafeRequest(pid=pid, notice_ids=[notice])).ok
        pid = runs.next()
        assert daemon.request(RegisterRequest(pid=pid, job_id="d", resumed_from_step=step)).ok
        assert daemon.request(ProgressRequest(pid=pid, job_id="d", step=step + 1,
                                              at=datetime.now(timezone.utc))).ok
        return daemon.request(CadenceRequest(job_id="d")).data["rate"]["interruptions"]

    assert daemon.request(RegisterRequest(pid=pid, job_id="d")).ok
    assert daemon.request(ProgressRequest(pid=pid, job_id="d", step=1, at=datetime.now(timezone.utc))).ok
    assert stop_and_resume(Kind.DRILL, 1) == 0
    assert stop_and_resume(Kind.PREEMPT, 1) == 1
    assert stop_and_resume(Kind.DRILL, 1) == 1
