"""GCP watchers against the metadata simulator: start-up state, long-poll wake-up, fallback, pacing."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from spotguard.protocol import Kind, utcnow
from spotguard_daemon.core.settings import Settings
from spotguard_daemon.simulator import Simulator
from spotguard_daemon.core.watchers.base import BadPayload
from spotguard_daemon.core.watchers.gcp import (GcpMaintenanceWatcher, GcpPreemptedWatcher,
                                           GcpPreemptibleWatcher, read_boot_time)
from spotguard_daemon.core.watchers.runner import Runner


def settings_for(url: str, **gcp) -> Settings:
    return Settings(gcp={"endpoint": f"{url}/computeMetadata/v1", "interval": 0.1,
                         "long_poll_timeout": 2, **gcp},
                    runner={"request_timeout": 0.5, "backoff_initial": 0.05, "backoff_max": 0.2})


@pytest.fixture
def sim():
    with Simulator("gcp") as sim:
        yield sim


def gets(sim, path):
    return sim.state()["requests"]["by_path"].get(f"GET /computeMetadata/v1/{path}", 0)


async def run_runner(watcher, settings, seconds, during=None):
    """Run a Runner for ``seconds``; returns [(monotonic time, snapshot)] handed to the sink."""
    seen = []
    task = asyncio.create_task(Runner(watcher, lambda w, s: seen.append((time.monotonic(), list(s))),
                                      settings.runner).run())
    if during is not None:
        await during(seen)
    await asyncio.sleep(seconds)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return seen


def with_client(make, body):
    async def main():
        async with httpx.AsyncClient() as http:
            return await body(make(http))

    return asyncio.run(main())


def test_pending_preemption_is_seen_by_the_first_poll(sim):
    sim.schedule("preempt")
    settings = settings_for(sim.url, long_poll_timeout=1)

    async def body(w):
        started = utcnow()
        first = await w.poll()
        second = await w.poll()  # a long-poll that times out with the value unchanged
        return started, first, second

    started, first, second = with_client(lambda http: GcpPreemptedWatcher(http, settings), body)
    assert first == second and len(first) == 1
    notice = first[0]
    assert notice.kind is Kind.PREEMPT and notice.terminating and notice.source == "gcp.preempted"
    assert timedelta(seconds=29) < notice.deadline - started < timedelta(seconds=32)


def test_long_poll_wakes_promptly_and_does_not_spin(sim):
    settings = settings_for(sim.url, long_poll_timeout=30)

    async def body(w):
        async def flip(seen):
            await asyncio.sleep(0.5)
            flip.at = time.monotonic()
            sim.schedule("preempt")
        return await run_runner(w, settings, 0.5, flip), flip.at

    seen, flipped = with_client(lambda http: GcpPreemptedWatcher(http, settings), body)
    arrived = next(t for t, snapshot in seen if snapshot)
    assert arrived - flipped < 0.25  # a 1 s poller would average 0.5 s
    assert gets(sim, "instance/preempted") <= 4  # plain GET, one long-poll, the answer, one more


@pytest.mark.parametrize("kind,expected,terminating", [
    ("terminate_maintenance", Kind.TERMINATE, True), ("migrate", Kind.MAINTENANCE, False)])
def test_maintenance_values_then_cancellation(sim, kind, expected, terminating):
    settings = settings_for(sim.url, long_poll_timeout=1)

    async def body(w):
        before = await w.poll()
        sim.schedule(kind)
        during = [await w.poll(), await w.poll()]
        sim.cancel()
        return before, during, await w.poll()

    before, during, after = with_client(lambda http: GcpMaintenanceWatcher(http, settings), body)
    assert before == [] and after == []
    assert during[0] == during[1] and len(during[0]) == 1
    notice = during[0][0]
    assert notice.kind is expected and notice.terminating is terminating
    assert timedelta(seconds=55) < notice.deadline - utcnow() <= timedelta(seconds=60)


def test_failed_long_poll_falls_back_to_plain_polling_then_retries(sim):
    settings = settings_for(sim.url)

    async def body(w):
        await w.poll()  # plain GET, now long-polling
        assert w.interval == 0 and w._value.long_polling
        sim.fault("503", count=1)
        with pytest.raises(httpx.HTTPStatusError):
            await w.poll()
        fallback = (w.interval, w._value.long_polling)
        await w.poll()  # plain
        await asyncio.sleep(0.3)
        return fallback, w._value.long_polling

    fallback, later = with_client(
        lambda http: GcpPreemptedWatcher(http, settings, retry_long_poll_after=0.3), body)
    assert fallback == (0.1, False)  # plain polls at gcp.interval
    assert later is True  # and long-polls again after the retry window


def test_a_server_ignoring_wait_for_change_is_paced():
    calls = []

    def handler(request):
        calls.append(request.url.params.get("wait_for_change"))
        return httpx.Response(200, text="FALSE", headers={"ETag": "abc"})

    settings = settings_for("http://metadata.test", interval=0.1)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await run_runner(GcpPreemptedWatcher(http, settings), settings, 0.55)

    asyncio.run(main())
    assert "true" in calls and 4 <= len(calls) <= 10  # unpaced, this would be thousands


def test_garbage_value_is_bad_payload(sim):
    sim.fault("garbage", count=5)
    settings = settings_for(sim.url)
    async def body(w):
        with pytest.raises(BadPayload):
            await w.poll()

    with_client(lambda http: GcpMaintenanceWatcher(http, settings), body)
    sim.clear("faults")


def boot_at(seconds_ago: float):
    return lambda: time.time() - seconds_ago


def test_preemptible_walltime_appears_lead_seconds_before_the_cap(sim):
    settings = settings_for(sim.url, preemptible="yes", preemptible_max_runtime=1000, preemptible_lead=100)

    async def body(make):
        early = await make(boot_at(800)).poll()  # cap in 200 s, lead 100 s: not yet
        late_watcher = make(boot_at(950))
        late = [await late_watcher.poll(), await late_watcher.poll()]
        return early, late

    early, late = with_client(lambda http: lambda boot: GcpPreemptibleWatcher(http, settings, boot), body)
    assert early == [] and late[0] == late[1] and len(late[0]) == 1
    notice = late[0][0]
    assert notice.kind is Kind.WALLTIME and notice.terminating
    assert timedelta(seconds=48) < notice.deadline - utcnow() < timedelta(seconds=52)
    assert gets(sim, "instance/scheduling/preemptible") == 0  # "yes" asks nobody


@pytest.mark.parametrize("preemptible", [True, False])
def test_preemptible_auto_asks_the_metadata_server_once(sim, preemptible):
    sim.set(preemptible=preemptible)
    settings = settings_for(sim.url, preemptible="auto", preemptible_max_runtime=100, preemptible_lead=100)

    async def body(w):
        return [await w.poll() for _ in range(3)]

    results = with_client(lambda http: GcpPreemptibleWatcher(http, settings, boot_at(10)), body)
    assert all(bool(r) is preemptible for r in results)
    assert gets(sim, "instance/scheduling/preemptible") == 1


def test_read_boot_time(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nbtime 1700000000\nprocesses 5\n")
    assert read_boot_time(stat) == 1700000000.0
    assert datetime.fromtimestamp(read_boot_time(), timezone.utc) < utcnow()
    stat.write_text("cpu 1\n")
    with pytest.raises(OSError):
        read_boot_time(stat)
