"""AWS watchers against the IMDSv2 simulator: kinds, deadlines, stable ids, cancellation, tokens."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime, timezone

import httpx
import pytest
from spotguard.protocol import Kind
from spotguard_daemon.core.settings import Settings
from spotguard_daemon.simulator import Simulator
from spotguard_daemon.core.watchers._common import MetadataToken
from spotguard_daemon.core.watchers.aws import (AwsRebalanceWatcher, AwsScheduledWatcher, AwsSpotWatcher,
                                           Imds)
from spotguard_daemon.core.watchers.base import BadPayload, WatcherError


def settings_for(url: str, **aws) -> Settings:
    return Settings(aws={"endpoint": url, "interval": 0.1, **aws}, runner={"request_timeout": 0.5})


def when(ts: float) -> datetime:
    return datetime.fromtimestamp(int(ts), timezone.utc)  # IMDS times have whole seconds


@pytest.fixture
def sim():
    with Simulator("aws") as sim:
        yield sim


def polls(settings, *steps, transport=None):
    """Run ``steps`` (callables taking the three watchers, returning an awaitable) in one client."""

    async def main():
        async with httpx.AsyncClient(transport=transport) as http:
            imds = Imds(http, settings)
            trio = (AwsSpotWatcher(imds, settings), AwsRebalanceWatcher(imds, settings),
                    AwsScheduledWatcher(imds, settings))
            return [await step(*trio) for step in steps]

    return asyncio.run(main())


def spot(w, *_):
    return w.poll()


@pytest.mark.parametrize("action,kind", [("terminate", Kind.TERMINATE), ("stop", Kind.STOP),
                                         ("hibernate", Kind.HIBERNATE)])
def test_spot_action_kinds_deadline_and_stable_id(sim, action, kind):
    event = sim.schedule(action, deadline_seconds=120)
    first, second = polls(settings_for(sim.url), spot, spot)
    assert first == second and len(first) == 1
    notice = first[0]
    assert notice.id == f"aws:spot:{action}" and notice.kind is kind and notice.terminating
    assert notice.deadline == when(event["deadline"]) and notice.source == "aws.spot"


def test_spot_nothing_pending_then_pending_then_cancelled(sim):
    def schedule(*_):
        sim.schedule("terminate")
        return asyncio.sleep(0)

    def cancel(*_):
        sim.cancel()
        return asyncio.sleep(0)

    before, _, during, _, after = polls(settings_for(sim.url), spot, schedule, spot, cancel, spot)
    assert before == [] and len(during) == 1 and after == []


def test_spot_keeps_the_first_deadline_when_the_time_jitters():
    """A common mock recomputes ``time`` per request: the notice must not change with it."""
    served = iter(range(100))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            return httpx.Response(200, text="tok")
        second = next(served)
        return httpx.Response(200, json={"action": "stop", "time": f"2030-01-01T00:02:{second:02d}Z"})

    first, second = polls(settings_for("http://imds.test"), spot, spot, transport=httpx.MockTransport(handler))
    assert first == second and first[0].deadline == datetime(2030, 1, 1, 0, 2, 0, tzinfo=timezone.utc)


def test_rebalance_is_advisory_without_deadline(sim):
    sim.schedule("rebalance")
    first, second = polls(settings_for(sim.url), lambda s, r, e: r.poll(), lambda s, r, e: r.poll())
    assert first == second and len(first) == 1
    notice = first[0]
    assert notice.kind is Kind.REBALANCE and not notice.terminating and notice.deadline is None
    assert notice.id.startswith("aws:rebalance:20")


@pytest.mark.parametrize("code,kind,terminating", [
    ("instance-stop", Kind.STOP, True), ("instance-retirement", Kind.TERMINATE, True),
    ("instance-reboot", Kind.REBOOT, True), ("system-reboot", Kind.REBOOT, True),
    ("system-maintenance", Kind.MAINTENANCE, False)])
def test_scheduled_event_codes(sim, code, kind, terminating):
    event = sim.schedule("scheduled", event_type=code, deadline_seconds=3600)
    [notices] = polls(settings_for(sim.url), lambda s, r, e: e.poll())
    assert [(n.id, n.kind, n.terminating, n.deadline) for n in notices] == [
        (event["id"], kind, terminating, when(event["deadline"]))]


def test_scheduled_canceled_and_completed_are_left_out(sim):
    kept = sim.schedule("scheduled", event_type="system-reboot")
    sim.schedule("scheduled", state="completed")
    sim.schedule("scheduled", state="canceled")
    gone = sim.schedule("scheduled", event_type="instance-stop")

    def cancel(*_):
        sim.cancel(gone["id"])
        return asyncio.sleep(0)

    before, _, after = polls(settings_for(sim.url), lambda s, r, e: e.poll(), cancel,
                             lambda s, r, e: e.poll())
    assert sorted(n.id for n in before) == sorted([kept["id"], gone["id"]])
    assert [n.id for n in after] == [kept["id"]]
    assert before[[n.id for n in before].index(kept["id"])] == after[0]  # unchanged, same received_at


def test_one_token_shared_and_refreshed_after_401(sim, caplog):
    sim.schedule("terminate")
    every = lambda s, r, e: asyncio.gather(s.poll(), r.poll(), e.poll())  # noqa: E731

    def expire(*_):
        sim.expire_tokens()
        return asyncio.sleep(0)

    with caplog.at_level(logging.INFO):
        results = polls(settings_for(sim.url), every, every, expire, every)
    assert [len(spot_notices) for spot_notices, *_ in (results[0], results[1], results[3])] == [1, 1, 1]
    assert sim.state()["tokens"]["issued"] == 2  # one before, one after the expiry, for all three
    assert any("fetching a new one" in r.getMessage() for r in caplog.records)


def test_imdsv1_is_off_by_default(sim):
    sim.set(imdsv1=True)  # the service would serve token-less requests
    sim.schedule("terminate")
    sim.fault("500", count=1)  # ... but the token PUT fails
    with pytest.raises(WatcherError, match="token PUT failed"):
        polls(settings_for(sim.url), spot)


def test_imdsv1_fallback_when_enabled(sim):
    sim.set(imdsv1=True)
    sim.schedule("hibernate")
    sim.fault("500", count=1)
    [notices] = polls(settings_for(sim.url, imdsv1_fallback=True), spot)
    assert [n.kind for n in notices] == [Kind.HIBERNATE]
    assert sim.state()["requests"]["by_path"].get("PUT /latest/api/token") == 1


def test_token_put_timeout_names_the_hop_limit_once(sim, caplog):
    sim.fault("hang", count=3)

    async def failing(w, *_):
        with pytest.raises(WatcherError, match="token PUT failed"):
            await w.poll()

    with caplog.at_level(logging.WARNING):
        polls(settings_for(sim.url), failing, failing, failing)
    hints = [r for r in caplog.records if "hop limit" in r.getMessage()]
    assert len(hints) == 1 and "hop-limit 2" in hints[0].getMessage()  # once, not once per poll
    sim.clear("faults")


def test_garbage_is_bad_payload_not_a_notice(sim):
    sim.fault("garbage", count=1000)
    sim.set(imdsv1=True)
    with pytest.raises(BadPayload):
        polls(settings_for(sim.url, imdsv1_fallback=True), spot)
    sim.clear("faults")


def test_unknown_action_is_bad_payload():
    def handler(request):
        return httpx.Response(200, text="tok" if request.method == "PUT" else json.dumps(
            {"action": "explode", "time": "2030-01-01T00:00:00Z"}))

    with pytest.raises(BadPayload):
        polls(settings_for("http://imds.test"), spot, transport=httpx.MockTransport(handler))


def test_token_is_renewed_shortly_before_it_expires(sim):
    now = [1000.0]

    async def main():
        async with httpx.AsyncClient() as http:
            token = MetadataToken(http, sim.url + "/latest/api/token", ttl=100, timeout=0.5,
                                  ttl_header="X-aws-ec2-metadata-token-ttl-seconds",
                                  token_header="X-aws-ec2-metadata-token", clock=lambda: now[0])
            fetched = []
            for at in (1000.0, 1050.0, 1089.0, 1091.0, 1100.0):  # renewed 10 s (10 %) early
                now[0] = at
                assert await token.get(sim.url + "/latest/meta-data/spot/instance-action") is None
                fetched.append(token.fetches)
            return fetched

    assert asyncio.run(main()) == [1, 1, 1, 2, 2]


def test_advisory_paths_are_polled_at_the_advisory_interval():
    async def main():
        async with httpx.AsyncClient() as http:
            settings = Settings(aws={"interval": 1.0, "advisory_interval": 5.0})
            imds = Imds(http, settings)
            return [w(imds, settings).interval for w in (AwsSpotWatcher, AwsRebalanceWatcher,
                                                          AwsScheduledWatcher)]

    assert asyncio.run(main()) == [1.0, 5.0, 5.0]
