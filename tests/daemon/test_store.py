"""NoticeStore: snapshot semantics, push sources, listeners, safe tracking, persistence."""

from __future__ import annotations

import json
import stat
from datetime import timedelta

from spotguard.protocol import Kind, Notice, utcnow
from spotguard_daemon.core.store import NoticeStore


def notice(nid: str, source: str = "aws.spot", seconds: float | None = 120, **kw) -> Notice:
    deadline = None if seconds is None else utcnow() + timedelta(seconds=seconds)
    return Notice(id=nid, platform="aws", kind=Kind.TERMINATE, deadline=deadline, source=source, **kw)


def recording(store: NoticeStore) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    store.on_announce(lambda n: events.append(("announce", n.id)))
    store.on_cancel(lambda n, reason: events.append(("cancel", n.id)))
    return events


def test_snapshot_announces_new_ids_once_and_cancels_vanished_ones():
    store = NoticeStore()
    events = recording(store)
    store.reconcile("aws.spot", [notice("a")])
    store.reconcile("aws.spot", [notice("a"), notice("b")])
    store.reconcile("aws.spot", [notice("b")])
    assert events == [("announce", "a"), ("announce", "b"), ("cancel", "a")]
    assert [n.id for n in store.pending()] == ["b"]


def test_same_id_again_keeps_the_first_received_at():
    store = NoticeStore()
    first = notice("a")
    store.reconcile("aws.spot", [first])
    later = notice("a", received_at=first.received_at + timedelta(seconds=30))
    store.reconcile("aws.spot", [later])
    assert store.get("a").received_at == first.received_at


def test_cancellation_is_tracked_per_source():
    store = NoticeStore()
    events = recording(store)
    store.reconcile("aws.spot", [notice("a")])
    store.reconcile("aws.rebalance", [])  # another source's empty snapshot cancels nothing
    assert events == [("announce", "a")]
    store.reconcile("aws.spot", [])
    assert events[-1] == ("cancel", "a")


def test_push_add_and_cancel():
    store = NoticeStore()
    events = recording(store)
    assert store.add(notice("m", source="manual"))
    assert not store.add(notice("m", source="manual"))
    assert store.cancel("m", "drill over")
    assert not store.cancel("m")
    assert events == [("announce", "m"), ("cancel", "m")]


def test_a_failing_listener_does_not_hide_the_notice_from_the_others():
    store = NoticeStore()
    store.on_announce(lambda n: 1 / 0)
    events = recording(store)
    store.add(notice("x"))
    assert events == [("announce", "x")]


def test_safe_tracking():
    store = NoticeStore()
    store.add(notice("a"))
    assert store.mark_safe("a", 101) and store.mark_safe("a", 102)
    assert not store.mark_safe("missing", 101)
    assert store.safe_pids("a") == {101, 102}
    store.cancel("a")
    assert store.safe_pids("a") == frozenset()


def test_persistence_is_private_atomic_and_re_announces(tmp_path):
    path = tmp_path / "state" / "notices.json"
    store = NoticeStore(path)
    store.reconcile("aws.spot", [notice("a")])
    store.mark_safe("a", 7)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not [p for p in path.parent.iterdir() if p.name != "notices.json"], "temp file left behind"

    again = NoticeStore(path)
    events = recording(again)
    restored = again.restore()
    assert [n.id for n in restored] == ["a"] and [n.id for n in again.pending()] == ["a"]
    assert events == []  # announced later, once the clients reconnected
    assert [n.id for n in again.announce_restored(restored)] == ["a"]
    assert events == [("announce", "a")]
    assert again.safe_pids("a") == {7}
    again.reconcile("aws.spot", [])  # the restored snapshot lets the watcher cancel it
    assert events[-1] == ("cancel", "a")
    assert json.loads(path.read_text())["notices"] == []


def test_restore_drops_notices_long_past_and_keeps_ephemeral_ones_out(tmp_path):
    path = tmp_path / "notices.json"
    store = NoticeStore(path, stale_after=60)
    store.add(notice("old", seconds=-3600))
    store.add(notice("fresh", seconds=30))
    store.add(notice("sig", source="signal"), ephemeral=True)
    assert [n.id for n in NoticeStore(path, stale_after=60).restore()] == ["fresh"]


def test_expire_cancels_stale_notices():
    store = NoticeStore(stale_after=10)
    events = recording(store)
    store.add(notice("stale", seconds=-11))
    store.add(notice("undated", seconds=None))
    assert store.expire() == ["stale"]
    assert events[-1] == ("cancel", "stale")
    assert [n.id for n in store.pending()] == ["undated"]


def test_unreadable_state_file_is_ignored(tmp_path):
    path = tmp_path / "notices.json"
    path.write_text("{not json")
    assert NoticeStore(path).restore() == []
    path.write_text(json.dumps({"version": 1, "notices": [{"notice": {"id": ""}}]}))
    assert NoticeStore(path).restore() == []


def test_a_rescheduled_event_is_announced_again_with_its_new_deadline():
    store = NoticeStore()
    announced: list[Notice] = []
    store.on_announce(announced.append)
    first = notice("evt", source="azure.scheduled", seconds=300)
    store.reconcile("azure.scheduled", [first])
    store.reconcile("azure.scheduled", [notice("evt", source="azure.scheduled", seconds=300.5)])
    assert len(announced) == 1  # jitter under a second is not a reschedule
    store.reconcile("azure.scheduled", [notice("evt", source="azure.scheduled", seconds=900)])
    assert [n.id for n in announced] == ["evt", "evt"]
    assert announced[1].deadline > first.deadline + timedelta(seconds=500)
    assert announced[1].received_at == first.received_at
    assert store.get("evt").deadline == announced[1].deadline


def restarted_with(path, original: Notice) -> tuple[NoticeStore, list[Notice], list[Notice]]:
    """A store that left ``original`` pending, then a new one over the same file: (store, the
    notices it restored, the notices it announced)."""
    NoticeStore(path).reconcile(original.source, [original])
    restarted = NoticeStore(path)
    announced: list[Notice] = []
    restarted.on_announce(announced.append)
    return restarted, restarted.restore(), announced


def test_a_restored_notice_keeps_its_deadline_when_its_source_lists_it_again(tmp_path):
    original = notice("gcp:preempt", source="gcp.preempted", seconds=30)
    restarted, restored, announced = restarted_with(tmp_path / "notices.json", original)
    restarted.announce_restored(restored)
    # The watcher of the new process computes its deadline from when *it* first saw the value,
    # and keeps reporting that later deadline at every poll: never a reschedule.
    for _ in range(3):
        restarted.reconcile("gcp.preempted", [notice("gcp:preempt", source="gcp.preempted", seconds=90)])
    assert [n.deadline for n in announced] == [original.deadline]
    assert restarted.get("gcp:preempt").deadline == original.deadline


def test_after_a_restart_only_the_platform_moves_a_deadline_and_the_notice_says_so(tmp_path):
    original = notice("evt", source="azure.scheduled", seconds=300)
    restarted, restored, announced = restarted_with(tmp_path / "notices.json", original)
    restarted.reconcile("azure.scheduled", [original])
    restarted.reconcile("azure.scheduled", [notice("evt", source="azure.scheduled", seconds=600)])
    assert len(announced) == 1 and "rescheduled by the platform" in announced[0].detail
    assert announced[0].deadline > original.deadline + timedelta(seconds=250)
    assert restarted.announce_restored(restored) == []  # the reschedule was announced already


def test_past_its_deadline_a_manual_notice_ends_and_a_platform_one_is_overdue_not_offered(tmp_path, caplog):
    now = [utcnow()]
    store = NoticeStore(tmp_path / "notices.json", clock=lambda: now[0])
    events = recording(store)
    store.reconcile("aws.spot", [notice("platform", seconds=10)])
    store.add(notice("drill", source="manual", seconds=10))
    assert [n.id for n in store.offered()] == ["platform", "drill"]
    now[0] += timedelta(seconds=10.5)  # past both deadlines, within the manual grace
    assert store.expire() == [] and store.offered() == []
    now[0] += timedelta(seconds=1)
    with caplog.at_level("WARNING"):
        assert store.expire() == ["drill"] and store.expire() == []
    assert ("cancel", "drill") in events and [n.id for n in store.pending()] == ["platform"]
    assert sum("passed its deadline" in r.getMessage() for r in caplog.records) == 1  # said once
    again = NoticeStore(tmp_path / "notices.json", clock=lambda: now[0])
    assert [n.id for n in again.restore({"aws.spot", "manual"})] == ["platform"]
    assert again.announce_restored(again.pending()) == []  # overdue: not published again
    assert NoticeStore(tmp_path / "notices.json").restore({"manual"}) == []  # not watched: dropped
