"""Azure Scheduled Events against the IMDS simulator: filtering, freeze threshold, acks, first call."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone

import httpx
import pytest
from spotguard.protocol import Kind, utcnow
from spotguard_daemon.core.settings import Settings
from spotguard_daemon.simulator import Simulator
from spotguard_daemon.core.watchers.azure import AzureScheduledWatcher
from spotguard_daemon.core.watchers.base import WatcherError


def settings_for(url: str, **azure) -> Settings:
    return Settings(azure={"endpoint": url, "interval": 0.1, "first_call_timeout": 3, **azure},
                    runner={"request_timeout": 0.5})


@pytest.fixture
def sim():
    with Simulator("azure", vm_name="worker-7") as sim:
        yield sim


def watching(settings, body, transport=None, **kwargs):
    async def main():
        async with httpx.AsyncClient(transport=transport) as http:
            return await body(AzureScheduledWatcher(http, settings, **kwargs))

    return asyncio.run(main())


async def twice(w):
    return [await w.poll(), await w.poll()]


def requests(sim, path):
    return sim.state()["requests"]["by_path"].get(f"GET {path}", 0)


@pytest.mark.parametrize("event_type,kind,terminating", [
    ("Preempt", Kind.PREEMPT, True), ("Terminate", Kind.TERMINATE, True), ("Reboot", Kind.REBOOT, True),
    ("Redeploy", Kind.REDEPLOY, True), ("Freeze", Kind.FREEZE, False)])
def test_event_types_deadline_and_stable_id(sim, event_type, kind, terminating):
    event = sim.schedule(event_type, duration=-1 if event_type == "Freeze" else None)
    first, second = watching(settings_for(sim.url), twice)
    assert first == second and len(first) == 1
    notice = first[0]
    assert (notice.id, notice.kind, notice.terminating) == (event["id"], kind, terminating)
    assert notice.deadline == datetime.fromtimestamp(int(event["deadline"]), timezone.utc)


def test_only_this_vms_events_and_name_read_once(sim):
    mine = sim.schedule("Preempt")
    sim.schedule("Preempt", resources=["worker-8", "worker-9"])
    both = sim.schedule("Reboot", resources=["worker-6", "WORKER-7"])

    async def body(w):
        return [await w.poll() for _ in range(3)]

    results = watching(settings_for(sim.url), body)
    assert [sorted(n.id for n in r) for r in results] == [sorted([mine["id"], both["id"]])] * 3
    assert requests(sim, "/metadata/instance/compute/name") == 1


def test_configured_vm_name_is_not_asked(sim):
    event = sim.schedule("Terminate", resources=["other"])
    [notices, _] = watching(settings_for(sim.url, vm_name="other"), twice)
    assert [n.id for n in notices] == [event["id"]]
    assert requests(sim, "/metadata/instance/compute/name") == 0


@pytest.mark.parametrize("duration,kept", [(9, False), (29, False), (30, True), (60, True), (-1, True)])
def test_freeze_threshold(sim, duration, kept):
    sim.schedule("Freeze", duration=duration)
    [notices, _] = watching(settings_for(sim.url, freeze_threshold=30), twice)
    assert bool(notices) is kept


def test_cancelled_event_disappears_and_incarnation_logged_per_change(sim, caplog):
    event = sim.schedule("Preempt")

    async def body(w):
        before = [await w.poll(), await w.poll()]
        sim.cancel(event["id"])
        return before, [await w.poll(), await w.poll()]

    with caplog.at_level(logging.INFO, logger="spotguard_daemon.core.watchers.azure"):
        before, after = watching(settings_for(sim.url), body)
    assert [len(x) for x in before] == [1, 1] and after == [[], []]
    changes = [r for r in caplog.records if "DocumentIncarnation" in r.getMessage()]
    assert len(changes) == 2  # first sight and the cancellation; not one per poll


def test_acknowledge_posts_start_requests(sim):
    event = sim.schedule("Reboot")

    async def body(w):
        await w.poll()
        await w.acknowledge([event["id"]])
        await w.acknowledge([])  # nothing to do, nothing sent
        return await w.poll()

    after = watching(settings_for(sim.url), body)
    assert [a["event_id"] for a in sim.state()["acks"]] == [event["id"]]
    assert after[0].raw["EventStatus"] == "Started"


def test_acknowledge_retries_then_gives_up(sim):
    event = sim.schedule("Preempt")
    sim.fault("503", count=2)
    watching(settings_for(sim.url, vm_name="worker-7"), lambda w: w.acknowledge([event["id"]]), ack_backoff=0.01)
    assert len(sim.state()["acks"]) == 1
    sim.fault("500", count=10)
    with pytest.raises(WatcherError, match="3 times"):
        watching(settings_for(sim.url), lambda w: w.acknowledge(["x"]), ack_backoff=0.01)
    sim.clear("faults")


def test_slow_first_call_gets_the_longer_timeout(sim):
    sim.set(first_call_delay=1.0)
    sim.schedule("Preempt")

    async def body(w):
        budget = w.poll_timeout
        started = time.monotonic()
        first = await w.poll()
        return budget, time.monotonic() - started, first, w.poll_timeout

    budget, took, first, later = watching(settings_for(sim.url), body)
    assert took >= 0.9 and len(first) == 1  # longer than request_timeout (0.5 s), and it waited
    assert budget > 3 > later


def test_started_event_without_not_before_means_now_and_stays_put():
    document = {"DocumentIncarnation": 3, "Events": [{
        "EventId": "E1", "EventStatus": "Started", "EventType": "Preempt", "ResourceType": "VirtualMachine",
        "Resources": ["vm-0"], "NotBefore": "", "DurationInSeconds": -1}]}

    def handler(request):
        return httpx.Response(200, json=document)

    started = utcnow()
    first, second = watching(settings_for("http://imds.test", vm_name="vm-0"), twice,
                             transport=httpx.MockTransport(handler))
    assert first == second
    assert 0 <= (first[0].deadline - started).total_seconds() < 1
