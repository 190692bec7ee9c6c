"""Metrics: a fresh registry per test, the real HTTP endpoint, and the values the daemon feeds."""

from __future__ import annotations

import math
from datetime import timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from spotguard.protocol import Kind, Notice, utcnow
from spotguard_daemon.core.metrics import Metrics

NAMES = {
    "spotguard_notices_total", "spotguard_poll_requests_total", "spotguard_poll_duration_seconds",
    "spotguard_notice_deadline_seconds", "spotguard_notice_delivery_latency_seconds",
    "spotguard_clients_connected", "spotguard_daemon_info",
}


class FakeWatcher:
    name = "aws.spot"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def served():
    metrics = Metrics()
    port = metrics.serve("127.0.0.1", 0)
    yield metrics, f"http://127.0.0.1:{port}/metrics"
    metrics.close()


def test_endpoint_serves_every_documented_name(served):
    metrics, url = served
    metrics.set_info("0.1.0", "aws")
    metrics.poll_done(FakeWatcher(), "ok", 0.01)
    metrics.notice_published(Notice(id="n", platform="aws", kind=Kind.TERMINATE))
    names = {family.name for family in text_string_to_metric_families(httpx.get(url).text)}
    # counters are exposed without their _total suffix as family names
    assert {n.removesuffix("_total") for n in NAMES} <= names


def test_polls_notices_and_info_carry_bounded_labels(served):
    metrics, url = served
    metrics.set_info("0.1.0", "gcp")
    for outcome in ("ok", "ok", "timeout"):
        metrics.poll_done(FakeWatcher(), outcome, 0.2)
    metrics.notice_published(Notice(id="n", platform="gcp", kind=Kind.PREEMPT))
    metrics.clients.set(3)
    got = samples(httpx.get(url).text)
    assert got[("spotguard_poll_requests_total", (("outcome", "ok"), ("source", "aws.spot")))] == 2
    assert got[("spotguard_poll_requests_total", (("outcome", "timeout"), ("source", "aws.spot")))] == 1
    assert got[("spotguard_poll_duration_seconds_count", (("source", "aws.spot"),))] == 3
    assert got[("spotguard_notices_total", (("kind", "preempt"), ("platform", "gcp")))] == 1
    assert got[("spotguard_notice_delivery_latency_seconds_count", ())] == 1
    assert got[("spotguard_daemon_info", (("platform", "gcp"), ("version", "0.1.0")))] == 1
    assert got[("spotguard_clients_connected", ())] == 3


def test_deadline_gauge_follows_the_nearest_pending_deadline():
    metrics = Metrics()
    pending: list[Notice] = []
    metrics.track_deadline(lambda: pending)
    value = lambda: metrics.registry.get_sample_value("spotguard_notice_deadline_seconds")  # noqa: E731
    assert math.isnan(value())
    pending += [Notice(id=i, platform="aws", kind=Kind.TERMINATE, deadline=utcnow() + timedelta(seconds=s))
                for i, s in (("far", 600), ("near", 100))]
    assert 95 < value() <= 100


def test_restored_notices_do_not_count_as_latency():
    metrics = Metrics()
    old = Notice(id="n", platform="aws", kind=Kind.TERMINATE, received_at=utcnow() - timedelta(hours=1))
    metrics.notice_published(old, latency=False)
    assert metrics.registry.get_sample_value("spotguard_notice_delivery_latency_seconds_count") == 0
    assert metrics.registry.get_sample_value(
        "spotguard_notices_total", {"platform": "aws", "kind": "terminate"}) == 1
