"""Alibaba ECS preemptible termination time against the simulator, with and without hardened mode."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import httpx
import pytest
from spotguard.protocol import Kind
from spotguard_daemon.core.settings import Settings
from spotguard_daemon.simulator import Simulator
from spotguard_daemon.core.watchers.alibaba import AlibabaPreemptWatcher
from spotguard_daemon.core.watchers.base import BadPayload


def settings_for(url: str, **alibaba) -> Settings:
    return Settings(alibaba={"endpoint": url, "interval": 0.1, **alibaba}, runner={"request_timeout": 0.5})


@pytest.fixture
def sim():
    with Simulator("alibaba") as sim:
        yield sim


def watching(settings, body):
    async def main():
        async with httpx.AsyncClient() as http:
            return await body(AlibabaPreemptWatcher(http, settings))

    return asyncio.run(main())


def puts(sim):
    return sim.state()["requests"]["by_path"].get("PUT /latest/api/token", 0)


def test_release_notice_lifecycle(sim):
    async def body(w):
        before = await w.poll()
        event = sim.schedule("terminate", deadline_seconds=300)
        during = [await w.poll(), await w.poll()]
        sim.cancel()
        return before, event, during, await w.poll()

    before, event, during, after = watching(settings_for(sim.url), body)
    assert before == [] and after == []
    assert during[0] == during[1] and len(during[0]) == 1
    notice = during[0][0]
    deadline = datetime.fromtimestamp(int(event["deadline"]), timezone.utc)
    assert notice.kind is Kind.PREEMPT and notice.terminating and notice.deadline == deadline
    assert notice.id == "alibaba:preempt:" + deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert puts(sim) == 1  # one hardened-mode token for every poll


def test_token_refreshed_after_expiry(sim):
    sim.schedule("terminate")

    async def body(w):
        first = await w.poll()
        sim.expire_tokens()
        return first, await w.poll()

    first, second = watching(settings_for(sim.url), body)
    assert first == second and len(first) == 1 and puts(sim) == 2


def test_without_hardened_mode_no_token_is_sent(sim):
    sim.set(hardened=False)
    sim.schedule("terminate")
    notices = watching(settings_for(sim.url, hardened=False), lambda w: w.poll())
    assert len(notices) == 1 and puts(sim) == 0


def test_hardened_instance_refuses_tokenless_requests(sim):
    with pytest.raises(httpx.HTTPStatusError) as caught:
        watching(settings_for(sim.url, hardened=False), lambda w: w.poll())
    assert caught.value.response.status_code == 403


def test_garbage_time_is_bad_payload(sim):
    sim.fault("garbage", count=10)
    sim.set(hardened=False)
    with pytest.raises(BadPayload):
        watching(settings_for(sim.url, hardened=False), lambda w: w.poll())
    sim.clear("faults")
