"""The notice timeline's rules, with a clock the test moves: the outcome each notice gets, what keeps
a timeline open, the bounded private history file and what a restart makes of an open timeline.
End to end through a real daemon and job: test_notice_timeline.py."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from spotguard.protocol import MAX_HISTORY, Kind, Notice, SafeRequest
from spotguard_daemon.core.timeline import LINGER_SECONDS, MAX_STAGES, REPLY_STAGES, Timelines

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


class Figures:
    def __init__(self) -> None:
        self.stages: list[tuple[str, float]] = []
        self.outcomes: list[tuple[str, int]] = []

    def notice_stage(self, stage: str, seconds: float) -> None:
        self.stages.append((stage, seconds))

    def notice_outcome(self, outcome: str, no_client_streak: int) -> None:
        self.outcomes.append((outcome, no_client_streak))


def notice(name: str, deadline_s: float | None = 30.0, kind: Kind = Kind.PREEMPT, seen_s: float = 0.0) -> Notice:
    seen = T0 + timedelta(seconds=seen_s)
    return Notice(id=name, platform="gcp", kind=kind, received_at=seen,
                  deadline=None if deadline_s is None else T0 + timedelta(seconds=deadline_s))


def make(tmp_path=None):
    clock, figures = Clock(), Figures()
    path = None if tmp_path is None else tmp_path / "timelines.json"
    return Timelines(path, figures, clock), clock, figures


def safe(clock: Clock, save: str, step: int = 7, **extra) -> SafeRequest:
    return SafeRequest(pid=10, flagged_at=clock.now, stopped_at=clock.now, step=step, save=save,
                       estimate_s=2.0, seconds_left=20.0, **extra)


def test_a_saved_notice_waits_for_its_durable_step_then_joins_the_history(tmp_path):
    lines, clock, figures = make(tmp_path)
    lines.seen(notice("a"), clients=1)
    clock.advance(1)
    lines.safe(["a"], 10, safe(clock, "committed", committed_at=clock.now), job="j")
    lines.all_safe("a")
    assert figures.outcomes == [("saved", 0)]
    lines.tick()
    assert lines.current()["waiting_for_durable"] == ["j"]
    lines.durable("j", 6)  # an older step is not the one stopped at
    assert lines.current()["waiting_for_durable"] == ["j"]
    clock.advance(2)
    lines.durable("j", 7)
    current = lines.current()
    assert [s["stage"] for s in current["stages"]] == ["seen", "flagged", "stopped", "committed", "safe",
                                                       "durable"]
    assert current["stages"][-1]["after_s"] == 3.0 and current["waiting_for_durable"] == []
    assert lines.history(5)[0]["id"] == "a"
    assert ("durable", 3.0) in figures.stages
    assert (tmp_path / "timelines.json").stat().st_mode & 0o777 == 0o600


def test_no_room_and_late_or_failed_saves_decide_the_outcome():
    lines, clock, figures = make()
    for name in ("room", "late", "failed"):
        lines.seen(notice(name), clients=1)
    lines.safe(["room"], 10, safe(clock, "no_room"), job="j")
    clock.advance(40)  # past the 30 s deadline
    lines.safe(["late"], 10, safe(clock, "committed", committed_at=clock.now), job="j")
    lines.safe(["failed"], 10, safe(clock, "failed"), job="j")
    for name in ("room", "late", "failed"):
        lines.all_safe(name)
    assert [o for o, _ in figures.outcomes] == ["no_room", "missed_deadline", "missed_deadline"]
    by_id = {t["id"]: t for t in lines.history(3)}
    room = next(s for s in by_id["room"]["stages"] if s["stage"] == "no_room")
    assert room["estimate_s"] == 2.0 and room["seconds_left"] == 20.0


def test_the_deadline_decides_missed_or_no_client_and_a_streak_counts_the_latter():
    lines, clock, figures = make()
    lines.seen(notice("idle-1", 1), clients=0)
    lines.seen(notice("busy", 1, seen_s=0.5), clients=1)
    lines.ack(["busy"], 10, clock.now)
    lines.seen(notice("advisory", 1, Kind.REBALANCE), clients=0)  # not terminating: no timeline
    lines.seen(notice("undated", None, seen_s=1), clients=0)
    clock.advance(2)
    lines.tick()
    assert sorted(o for o, _ in figures.outcomes) == ["missed_deadline", "no_client"]
    lines.cancelled("undated", "expired")  # no deadline, no client: found none
    assert figures.outcomes[-1] == ("no_client", 1)  # the busy one in between ended the first streak
    assert {t["id"] for t in lines.history(10)} == {"idle-1", "busy", "undated"}


def test_a_cancel_with_clients_is_cancelled_and_open_ones_survive_a_restart(tmp_path):
    lines, clock, figures = make(tmp_path)
    lines.seen(notice("c"), clients=1)
    lines.ack(["c"], 10, clock.now)
    lines.cancelled("c", "gcp.preempted: no longer pending")
    assert figures.outcomes == [("cancelled", 0)]
    lines.seen(notice("kept", 600), clients=1)
    lines.seen(notice("gone", 600), clients=1)
    clock.advance(3)
    lines.tick()
    again, _, _ = make(tmp_path)
    again.restore({"kept"})  # the notice store restored "kept" only
    kept = again.current()
    assert kept["id"] == "kept" and kept["stages"][-1]["stage"] == "daemon_stopped"
    assert {t["id"] for t in again.history(10)} == {"c", "kept", "gone"}


def test_the_history_is_bounded_and_a_damaged_file_is_ignored(tmp_path):
    lines, clock, _ = make(tmp_path)
    for number in range(MAX_HISTORY + 5):
        lines.seen(notice(f"n{number}", 1, seen_s=number), clients=0)
        clock.advance(LINGER_SECONDS)
        lines.tick()
    assert len(lines.history(MAX_HISTORY)) == MAX_HISTORY
    huge, _, _ = make()
    for number in range(20):  # notices with many clients keep their first MAX_STAGES stages
        huge.seen(notice(f"h{number}", 600, seen_s=number), clients=MAX_STAGES)
        for pid in range(1, MAX_STAGES + 10):
            huge.ack([f"h{number}"], pid, clock.now)
    assert all(len(t["stages"]) == MAX_STAGES for t in huge.history(20))
    assert len(huge.history(20)) == REPLY_STAGES // MAX_STAGES  # the reply stays bounded
    assert len(json.loads((tmp_path / "timelines.json").read_text())["history"]) == MAX_HISTORY
    (tmp_path / "timelines.json").write_text('{"version": 1, "open": [{"id": 3}], "history": []}')
    again, _, _ = make(tmp_path)
    again.restore(set())
    assert again.current() is None
