"""The goodput ledger's arithmetic on a fake clock: exact seconds, bounds, persistence, bad input."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from spotguard_daemon.core.goodput import MAX_COMMITS, MAX_REPORT_AGE, MAX_STAMP_AGE, GoodputLedger, Loss


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def test_a_restart_loses_the_steps_and_time_after_the_last_commit(tmp_path):
    clock = Clock()
    ledger = GoodputLedger(tmp_path / "goodput.json", clock=clock)
    assert ledger.restarted("j", 0, pid=1) is None  # nothing known of the job yet
    assert ledger.progress("j", 10, at(clock.now + 10), pid=1) == 0.0  # a report from the future is now
    with pytest.raises(ValueError, match="old"):
        ledger.progress("j", 11, at(clock.now - MAX_REPORT_AGE - 1), pid=1)
    clock.now += 20
    ledger.committed("j", 20)
    clock.now += 5
    assert ledger.progress("j", 30, at(clock.now - 5), pid=1) == 20.0
    assert ledger.progress("j", 35, at(clock.now), pid=1) == 5.0
    clock.now += 100
    ledger.flush(force=True)
    again = GoodputLedger(tmp_path / "goodput.json", clock=clock)  # a daemon restart
    assert again.restarted("j", 20, pid=2) == Loss(steps=15, seconds=5.0, downtime=100.0)
    clock.now += 7
    assert again.progress("j", 22, at(clock.now), pid=2) == 7.0
    clock.now += 3
    assert again.restarted("j", 20, pid=3) == Loss(steps=2, seconds=7.0, downtime=3.0)  # from the last resume
    clock.now += 10
    assert again.progress("j", 25, at(clock.now), pid=3) == 10.0
    again.committed("j", 24)  # arrives after the report of step 25, which showed it reached
    clock.now += 4
    assert again.progress("j", 28, at(clock.now), pid=3) == 4.0
    # Resumed from 20 (24 was lost): steps 20-24 are committed steps re-run, counted apart.
    # Step 24 was reached by step 25's report at the latest.
    assert again.restarted("j", 20, pid=4) == Loss(steps=4, seconds=4.0, downtime=0.0)
    assert again.progress("j", 21, at(clock.now + 1), pid=5) == 0.0  # another process: not a run's time
    assert again.progress("k", 9, at(clock.now), pid=7) == 0.0
    assert again.restarted("k", 5, pid=8) == Loss(steps=4, seconds=None, downtime=0.0)  # step 5's time unknown


def test_jobs_and_commits_are_bounded_and_bad_state_is_ignored(tmp_path):
    path = tmp_path / "goodput.json"
    ledger = GoodputLedger(path, max_jobs=3)
    for job in "abcd":
        ledger.progress(job, 1, datetime.now(timezone.utc), pid=1)
    for step in range(2 * MAX_COMMITS):
        ledger.committed("d", step)
    ledger.flush(force=True)
    doc = json.loads(path.read_text())
    assert [j["job"] for j in doc["jobs"]] == ["b", "c", "d"]
    assert len(doc["jobs"][-1]["reached"]) == MAX_COMMITS
    assert path.stat().st_mode & 0o777 == 0o600
    for garbage in (b"{", b"[]", b'{"version": 1, "jobs": [{"job": "a"}]}', b'{"version": 9, "jobs": []}'):
        path.write_bytes(garbage)
        assert GoodputLedger(path).restarted("b", 0, pid=1) is None


def test_only_rank_0_records_are_handed_to_the_store_once_per_interval():
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    ledger.committed("other-node", 4)  # only commits: another node's ranks, never copied
    ledger.progress("j", 5, at(clock.now), pid=1)
    assert [(job, r.step) for job, r in ledger.due(3600)] == [("j", 5)]  # a first change goes at once
    ledger.progress("j", 6, at(clock.now), pid=1)
    assert ledger.due(3600) == []  # within the interval
    assert [(job, r.step) for job, r in ledger.due(0)] == [("j", 6)]  # a notice pending: at once
    assert ledger.due(0) == []  # nothing changed since


def test_a_record_older_than_the_step_resumed_from_means_the_job_ran_elsewhere():
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    ledger.progress("j", 10, at(clock.now), pid=1)
    ledger.committed("j", 8)
    clock.now += 60
    assert ledger.restarted("j", 20, pid=2) is None  # resumed past all this node saw: ask the store
    clock.now += 5
    ledger.progress("j", 23, at(clock.now), pid=2)
    assert ledger.restarted("j", 20, pid=3) == Loss(steps=3, seconds=5.0, downtime=0.0)


def test_a_commit_reported_after_later_progress_counts_from_when_its_step_was_reached():
    """The commit of step 4 is written in the background and arrives after the reports of steps 5-7:
    the client's stamp, not its arrival or the newest report, says when step 4 was reached."""
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    reached_4 = clock.now
    for step in (5, 6, 7):
        clock.now += 1
        ledger.progress("j", step, at(clock.now), pid=1)
    clock.now += 2
    ledger.committed("j", 4, at(reached_4))
    assert ledger.restarted("j", 4, pid=2) == Loss(steps=3, seconds=3.0, downtime=2.0)
    # Without the stamp (an older client) the newest report bounds it: no second is known lost.
    for step in (5, 6, 7):
        clock.now += 1
        ledger.progress("j", step, at(clock.now), pid=2)
    ledger.committed("j", 4)
    assert ledger.restarted("j", 4, pid=3) == Loss(steps=3, seconds=0.0, downtime=0.0)


@pytest.mark.parametrize("offset", [3600.0, -MAX_STAMP_AGE - 1], ids=["future", "too-old"])
def test_a_commit_stamp_from_the_future_counts_as_now_and_a_too_old_one_as_unknown(offset):
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    ledger.progress("j", 6, at(clock.now), pid=1)
    clock.now += 2
    ledger.committed("j", 4, at(clock.now + offset))  # untrusted: bounded by the newest report
    clock.now += 1
    ledger.progress("j", 7, at(clock.now), pid=1)
    expected = 1.0 if offset > 0 else 3.0  # from now (the arrival), or from the report of step 6
    assert ledger.restarted("j", 4, pid=2) == Loss(steps=3, seconds=expected, downtime=0.0)


def test_a_report_is_bounded_by_minutes_and_its_registration_a_commit_stamp_more_loosely():
    """Issue 21.2: a report dated an hour back (3,500 s of made-up training time) or before its
    process registered is refused; a commit of a large save may still name a step reached 10 min ago."""
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    with pytest.raises(ValueError, match="old"):
        ledger.progress("j", 1, at(clock.now - 3500), pid=1)
    with pytest.raises(ValueError, match="before its process registered"):
        ledger.progress("j", 1, at(clock.now - 60), pid=1, not_before=clock.now - 10)
    assert ledger.progress("j", 1, at(clock.now - 5), pid=1, not_before=clock.now - 10) == 0.0
    ledger.committed("j", 1, at(clock.now - 600))
    clock.now += 1
    ledger.progress("j", 3, at(clock.now), pid=1)
    assert ledger.restarted("j", 1, pid=2).seconds == 601.0  # the stamp, not the arrival, was trusted
