"""Every platform end to end: the simulator and the daemon as subprocesses, a real SUB client.

Per platform: schedule an interruption and see the notice (kind, deadline) arrive; inject a fault
(three 503s) and see that it neither cancels the notice nor stops the daemon; cancel the event and
see the cancel arrive once the fault healed, the failed polls counted in the metrics; schedule again.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from spotguard.protocol import Kind, StatusRequest, decode_event

pytestmark = pytest.mark.slow

# platform: (simulator kind, expected notice kind, deadline seconds, endpoint suffix)
CASES = {
    "aws": ("terminate", Kind.TERMINATE, 120, ""),
    "gcp": ("preempt", Kind.PREEMPT, 30, "/computeMetadata/v1"),
    "azure": ("Preempt", Kind.PREEMPT, 60, ""),
    "alibaba": ("terminate", Kind.PREEMPT, 300, ""),
}


def control(url: str, op: str, **body) -> dict:
    response = httpx.post(f"{url}/_sim/{op}", json=body, timeout=5)
    response.raise_for_status()
    return response.json()


def events(sub, seconds: float, until: str | None = None) -> list:
    """Events (not heartbeats) received within ``seconds``, stopping early at topic ``until``."""
    got, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and sub.poll(int(left * 1000)):
        topic, data = sub.recv_multipart()
        if topic != b"heartbeat":
            got.append(decode_event(data))
            if topic == (until or "").encode():
                break
    return got


def poll_outcomes(metrics_url: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=5).text):
        for sample in family.samples:
            if sample.name == "spotguard_poll_requests_total":
                outcome = sample.labels["outcome"]
                totals[outcome] = totals.get(outcome, 0) + sample.value
    return totals


@pytest.mark.parametrize("platform", sorted(CASES))
def test_notice_fault_cancel_for_each_platform(platform, simulator, daemon_factory):
    sim_kind, kind, deadline, suffix = CASES[platform]
    url = simulator(platform)
    env = {f"SPOTGUARD_{platform.upper()}__ENDPOINT": url + suffix,
           f"SPOTGUARD_{platform.upper()}__INTERVAL": "0.2",
           "SPOTGUARD_RUNNER__BACKOFF_INITIAL": "0.1", "SPOTGUARD_RUNNER__BACKOFF_MAX": "0.5",
           "SPOTGUARD_RUNNER__REQUEST_TIMEOUT": "1", "SPOTGUARD_DELIVERY__SIGNAL": "none"}
    daemon = daemon_factory("--platform", platform, env=env)
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(daemon.pub_endpoint)
        events(sub, 0.5)  # let the subscription settle (heartbeats flow)

        event = control(url, "schedule", kind=sim_kind, in_seconds=0.1, deadline_seconds=deadline)
        got = [e for e in events(sub, 10, until="notice") if e.type == "notice"]
        assert got, f"no notice: {daemon.output()[-2000:]}"
        notice = got[0].notice
        assert notice.kind is kind and notice.platform == platform
        assert deadline - 5 < notice.seconds_left() <= deadline + 1

        # The next 3 requests fail. GCP's long-poll is already waiting, so it meets the fault
        # only after the cancel wakes it up: the cancel must still arrive once the fault heals.
        control(url, "fault", mode="503", count=3)
        during = events(sub, 1.0)
        assert not [e for e in during if e.type in ("cancel", "notice")], during

        control(url, "cancel", id=event["id"])
        cancels = [e for e in events(sub, 10, until="cancel") if e.type == "cancel"]
        assert [c.id for c in cancels] == [notice.id]
        metrics_url = daemon.request(StatusRequest()).data["metrics"]
        assert poll_outcomes(metrics_url).get("http_error", 0) > 0

        control(url, "schedule", kind=sim_kind, in_seconds=0.1, deadline_seconds=deadline)
        assert [e for e in events(sub, 10, until="notice") if e.type == "notice"]
        assert daemon.proc.poll() is None
        assert daemon.stop() == 0
    finally:
        ctx.destroy(linger=0)


RECORDER = "import time; print('ready', flush=True); time.sleep(60)"


def azure_daemon(simulator, daemon_factory, **env):
    url = simulator("azure")
    daemon = daemon_factory("--platform", "azure", env={
        "SPOTGUARD_AZURE__ENDPOINT": url, "SPOTGUARD_AZURE__INTERVAL": "0.2",
        "SPOTGUARD_DELIVERY__SIGNAL": "none", **env})
    return url, daemon


def acks(url: str) -> list[str]:
    return [a["event_id"] for a in httpx.get(f"{url}/_sim/state", timeout=5).json()["acks"]]


def wait_pending(daemon, count: int = 1, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        notices = daemon.request(StatusRequest()).data["notices"]
        if len(notices) >= count:
            return notices
        time.sleep(0.1)
    raise AssertionError(f"no pending notice: {daemon.output()[-2000:]}")


def test_azure_event_is_acknowledged_once_every_client_is_safe(simulator, daemon_factory):
    from spotguard.protocol import RegisterRequest, SafeRequest

    url, daemon = azure_daemon(simulator, daemon_factory)
    child = subprocess.Popen([sys.executable, "-c", RECORDER], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        assert daemon.request(RegisterRequest(pid=child.pid)).ok
        event = control(url, "schedule", kind="Preempt", in_seconds=0.1, deadline_seconds=120)
        [notice] = wait_pending(daemon)
        time.sleep(0.6)
        assert acks(url) == [], "no acknowledgement before the client is safe"
        assert daemon.request(SafeRequest(pid=child.pid, notice_ids=[notice["id"]])).ok
        for _ in range(50):
            if acks(url):
                break
            time.sleep(0.1)
        assert acks(url) == [event["id"]]
    finally:
        child.kill()
        child.wait()


def test_azure_event_is_acknowledged_at_its_deadline_and_never_when_off(simulator, daemon_factory):
    url, daemon = azure_daemon(simulator, daemon_factory)
    # deadlines of seconds, not one: under a loaded CI the notice was once overdue before wait_pending looked
    event = control(url, "schedule", kind="Preempt", in_seconds=0.1, deadline_seconds=3)
    wait_pending(daemon)
    for _ in range(100):
        if acks(url):
            break
        time.sleep(0.1)
    assert acks(url) == [event["id"]]
    assert daemon.stop() == 0

    url, daemon = azure_daemon(simulator, daemon_factory, SPOTGUARD_AZURE__ACKNOWLEDGE="false")
    control(url, "schedule", kind="Preempt", in_seconds=0.1, deadline_seconds=3)
    wait_pending(daemon)
    time.sleep(3.5)  # past the deadline, when an acknowledging daemon would have answered
    assert acks(url) == []


def test_unreachable_platform_keeps_the_daemon_up_counting_errors_quietly(daemon_factory):
    import json
    import socket

    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = daemon_factory("--platform", "aws", env={
        "SPOTGUARD_AWS__ENDPOINT": f"http://127.0.0.1:{port}", "SPOTGUARD_AWS__INTERVAL": "0.05",
        "SPOTGUARD_RUNNER__BACKOFF_INITIAL": "0.01", "SPOTGUARD_RUNNER__BACKOFF_MAX": "0.05",
        "SPOTGUARD_LOG_FORMAT": "json"})
    time.sleep(2.0)
    assert daemon.proc.poll() is None
    errors = poll_outcomes(daemon.request(StatusRequest()).data["metrics"])
    assert errors.get("connect_error", 0) + errors.get("error", 0) >= 10, errors
    assert daemon.stop() == 0
    lines = [json.loads(line) for line in daemon.output().splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "msg"} <= set(doc) for doc in lines)
    runner_lines = [doc for doc in lines if doc["logger"].endswith("runner")]
    assert 1 <= len(runner_lines) <= 6, runner_lines  # state changes, not one line per poll
