"""The platform simulator, driven over real HTTP (httpx) on 127.0.0.1, plus a real subprocess."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from email.utils import parsedate_to_datetime
from typing import Iterator

import httpx
import pytest

from spotguard_daemon.simulator import ControlError, Simulator, parse_option
from spotguard_daemon.core.watchers.base import parse_time

AWS_TTL = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN = "X-aws-ec2-metadata-token"
ALI_TTL = "X-aliyun-ecs-metadata-token-ttl-seconds"
ALI_TOKEN = "X-aliyun-ecs-metadata-token"
SPOT = "/latest/meta-data/spot/instance-action"
GCP = {"Metadata-Flavor": "Google"}
AZ = {"Metadata": "true"}
AZ_EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
ALI_TERM = "/latest/meta-data/instance/spot/termination-time"


@pytest.fixture
def start() -> Iterator:
    """Start simulators (stopped at the end); returns ``(sim, client)``."""
    running: list[tuple[Simulator, httpx.Client]] = []

    def _start(platform: str, **options) -> tuple[Simulator, httpx.Client]:
        sim = Simulator(platform, **options)
        client = httpx.Client(base_url=sim.url, timeout=10)
        running.append((sim, client))
        return sim, client

    yield _start
    for sim, client in running:
        client.close()
        sim.stop()


def aws_token(client: httpx.Client, ttl: int = 60) -> dict[str, str]:
    resp = client.put("/latest/api/token", headers={AWS_TTL: str(ttl)})
    assert resp.status_code == 200
    return {AWS_TOKEN: resp.text}


# ------------------------------------------------------------------------ AWS


@pytest.mark.parametrize("ttl", [None, "0", "21601", "-5", "abc"])
def test_aws_token_put_rejects_bad_ttl(start, ttl):
    _, client = start("aws")
    headers = {} if ttl is None else {AWS_TTL: ttl}
    assert client.put("/latest/api/token", headers=headers).status_code == 400


def test_aws_token_rules(start):
    _, client = start("aws")
    resp = client.put("/latest/api/token", headers={AWS_TTL: "21600"})
    assert resp.status_code == 200 and len(resp.text) > 20
    assert resp.headers[AWS_TTL] == "21600"
    assert client.get(SPOT).status_code == 401  # IMDSv2 only: no token, no answer
    assert client.get(SPOT, headers={AWS_TOKEN: "forged"}).status_code == 401
    assert client.get(SPOT, headers={AWS_TOKEN: resp.text}).status_code == 404
    assert client.get("/latest/api/token").status_code == 405


def test_aws_token_expires_after_its_ttl(start):
    _, client = start("aws")
    headers = aws_token(client, ttl=1)
    assert client.get(SPOT, headers=headers).status_code == 404
    time.sleep(1.1)
    assert client.get(SPOT, headers=headers).status_code == 401


def test_aws_expire_tokens_control_call(start):
    sim, client = start("aws")
    headers = aws_token(client)
    assert client.post("/_sim/expire_tokens").json() == {"expired": 1}
    assert client.get(SPOT, headers=headers).status_code == 401
    assert client.get(SPOT, headers=aws_token(client)).status_code == 404
    assert sim.state()["tokens"] == {"issued": 2, "live": 1}


def test_aws_imdsv1_allowed_when_configured(start):
    _, client = start("aws", imdsv1=True)
    assert client.get(SPOT).status_code == 404
    assert client.get(SPOT, headers={AWS_TOKEN: "forged"}).status_code == 401  # as on EC2
    assert client.post("/_sim/set", json={"imdsv1": "false"}).json() == {"imdsv1": False}
    assert client.get(SPOT).status_code == 401


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_aws_spot_instance_action(start, action):
    sim, client = start("aws")
    headers = aws_token(client)
    event = sim.schedule(action, deadline_seconds=120)
    first = client.get(SPOT, headers=headers)
    assert first.status_code == 200
    body = first.json()
    assert body["action"] == action
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", body["time"])
    assert abs(parse_time(body["time"]).timestamp() - event["deadline"]) < 1
    time.sleep(0.01)
    assert client.get(SPOT, headers=headers).json() == body  # pinned, not recomputed per request
    legacy = client.get("/latest/meta-data/spot/termination-time", headers=headers)
    assert (legacy.status_code, legacy.text if action == "terminate" else None) == \
        ((200, body["time"]) if action == "terminate" else (404, None))
    sim.cancel(event["id"])
    assert client.get(SPOT, headers=headers).status_code == 404


def test_aws_rebalance_recommendation(start):
    sim, client = start("aws")
    headers = aws_token(client)
    path = "/latest/meta-data/events/recommendations/rebalance"
    assert client.get(path, headers=headers).status_code == 404
    event = sim.schedule("rebalance")
    notice = parse_time(client.get(path, headers=headers).json()["noticeTime"])
    assert abs(notice.timestamp() - event["flipped_at"]) < 1
    assert client.get(SPOT, headers=headers).status_code == 404  # advisory only


def test_aws_scheduled_events_and_history(start):
    sim, client = start("aws")
    headers = aws_token(client)
    path = "/latest/meta-data/events/maintenance/scheduled"
    assert client.get(path, headers=headers).json() == []
    event = sim.schedule("scheduled", deadline_seconds=3600, event_type="instance-stop", duration=600)
    [item] = client.get(path, headers=headers).json()
    assert item["EventId"] == event["id"] and item["EventId"].startswith("instance-event-")
    assert (item["Code"], item["State"]) == ("instance-stop", "active")
    fmt = r"\d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT"
    assert re.fullmatch(fmt, item["NotBefore"]) and re.fullmatch(fmt, item["NotAfter"])
    assert abs(parse_time(item["NotBefore"]).timestamp() - event["deadline"]) < 1
    assert (parse_time(item["NotAfter"]) - parse_time(item["NotBefore"])).total_seconds() == 600
    sim.cancel(event["id"])
    assert client.get(path, headers=headers).json() == []
    [old] = client.get("/latest/meta-data/events/maintenance/history", headers=headers).json()
    assert (old["EventId"], old["State"]) == (event["id"], "canceled")


def test_aws_scheduled_state_override_and_validation(start):
    sim, client = start("aws")
    sim.schedule("scheduled", state="completed")
    [item] = client.get("/latest/meta-data/events/maintenance/scheduled", headers=aws_token(client)).json()
    assert item["State"] == "completed"
    assert client.post("/_sim/schedule", json={"kind": "scheduled", "event_type": "nope"}).status_code == 400
    with pytest.raises(ControlError):
        sim.schedule("scheduled", state="weird")


# ------------------------------------------------------------------------ GCP


def test_gcp_requires_metadata_flavor(start):
    _, client = start("gcp")
    resp = client.get("/computeMetadata/v1/instance/preempted")
    assert resp.status_code == 403 and resp.headers["Metadata-Flavor"] == "Google"
    assert client.get("/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Bing"}).status_code == 403
    assert client.get("/computeMetadata/v1/instance/nothing", headers=GCP).status_code == 404


@pytest.mark.parametrize("kind, path, value", [
    ("preempt", "instance/preempted", "TRUE"),
    ("migrate", "instance/maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE"),
    ("terminate_maintenance", "instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE"),
])
def test_gcp_values_flip_and_cancel(start, kind, path, value):
    sim, client = start("gcp")
    url = "/computeMetadata/v1/" + path
    before = client.get(url, headers=GCP)
    assert before.text in ("FALSE", "NONE") and before.headers["Metadata-Flavor"] == "Google"
    event = sim.schedule(kind)
    during = client.get(url, headers=GCP)
    assert during.text == value and during.headers["ETag"] != before.headers["ETag"]
    sim.cancel(event["id"])
    after = client.get(url, headers=GCP)
    assert after.text == before.text and after.headers["ETag"] == before.headers["ETag"]


def test_gcp_preemptible_is_settable(start):
    sim, client = start("gcp", preemptible=False)
    url = "/computeMetadata/v1/instance/scheduling/preemptible"
    assert client.get(url, headers=GCP).text == "FALSE"
    sim.set(preemptible=True)
    assert client.get(url, headers=GCP).text == "TRUE"
    assert client.post("/_sim/set", json={"colour": "red"}).status_code == 400


def test_gcp_long_poll_wakes_at_the_flip(start):
    sim, client = start("gcp")
    url = "/computeMetadata/v1/instance/preempted"
    etag = client.get(url, headers=GCP).headers["ETag"]
    event = sim.schedule("preempt", in_seconds=0.3)
    resp = client.get(url, headers=GCP, params={"wait_for_change": "true", "last_etag": etag, "timeout_sec": 10})
    answered = time.time()
    flipped = sim.state()["events"][0]["flipped_at"]
    assert resp.text == "TRUE" and resp.headers["ETag"] != etag
    assert abs(flipped - event["flip_at"]) < 0.1  # the timer flipped it on time, no request needed
    assert 0 <= answered - flipped < 0.1  # typically ~1 ms; loose for loaded CI machines


def test_gcp_long_poll_times_out_with_the_current_value(start):
    _, client = start("gcp")
    url = "/computeMetadata/v1/instance/maintenance-event"
    etag = client.get(url, headers=GCP).headers["ETag"]
    began = time.monotonic()
    resp = client.get(url, headers=GCP, params={"wait_for_change": "true", "last_etag": etag, "timeout_sec": 1})
    assert 0.9 < time.monotonic() - began < 2
    assert (resp.text, resp.headers["ETag"]) == ("NONE", etag)


def test_gcp_long_poll_with_a_stale_etag_answers_at_once(start):
    sim, client = start("gcp")
    sim.schedule("preempt")
    began = time.monotonic()
    resp = client.get("/computeMetadata/v1/instance/preempted", headers=GCP,
                      params={"wait_for_change": "true", "last_etag": "0000", "timeout_sec": 30})
    assert resp.text == "TRUE" and time.monotonic() - began < 1
    bad = client.get("/computeMetadata/v1/instance/preempted", headers=GCP,
                     params={"wait_for_change": "true", "timeout_sec": "soon"})
    assert bad.status_code == 400


# ------------------------------------------------------------------------ Azure


def test_azure_requires_header_and_api_version(start):
    _, client = start("azure")
    assert client.get(AZ_EVENTS).status_code == 400
    resp = client.get("/metadata/scheduledevents", headers=AZ)
    assert resp.status_code == 400 and "api-version" in resp.json()["error"]


def test_azure_document_and_incarnation(start):
    sim, client = start("azure", vm_name="vm-7")
    empty = client.get(AZ_EVENTS, headers=AZ).json()
    assert empty["Events"] == []
    event = sim.schedule("Preempt", deadline_seconds=30)
    doc = client.get(AZ_EVENTS, headers=AZ).json()
    assert doc["DocumentIncarnation"] == empty["DocumentIncarnation"] + 1
    [item] = doc["Events"]
    assert re.fullmatch(r"[0-9A-F]{8}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{12}", item["EventId"])
    assert item["EventId"] == event["id"]
    assert {k: item[k] for k in ("EventType", "ResourceType", "Resources", "EventStatus", "EventSource",
                                 "DurationInSeconds")} == {
        "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": ["vm-7"],
        "EventStatus": "Scheduled", "EventSource": "Platform", "DurationInSeconds": -1}
    assert item["NotBefore"].endswith(" GMT") and item["Description"]
    assert abs(parsedate_to_datetime(item["NotBefore"]).timestamp() - event["deadline"]) < 1
    sim.schedule("Freeze", resources=["vm-1", "vm-2"])
    doc2 = client.get(AZ_EVENTS, headers=AZ).json()
    freeze = doc2["Events"][1]
    assert (freeze["Resources"], freeze["DurationInSeconds"]) == (["vm-1", "vm-2"], 9)
    sim.cancel(event["id"])
    doc3 = client.get(AZ_EVENTS, headers=AZ).json()
    assert [e["EventType"] for e in doc3["Events"]] == ["Freeze"]
    assert doc3["DocumentIncarnation"] == doc2["DocumentIncarnation"] + 1


def test_azure_acknowledgement_starts_then_removes_the_event(start):
    sim, client = start("azure", started_linger=0.6)
    event = sim.schedule("Terminate")
    before = client.get(AZ_EVENTS, headers=AZ).json()["DocumentIncarnation"]
    ack = client.post(AZ_EVENTS, headers=AZ, json={"StartRequests": [{"EventId": event["id"]}]})
    assert ack.status_code == 200
    [acked] = sim.state()["acks"]
    assert (acked["event_id"], acked["known"]) == (event["id"], True)
    doc = client.get(AZ_EVENTS, headers=AZ).json()
    assert doc["Events"][0]["EventStatus"] == "Started" and doc["DocumentIncarnation"] == before + 1
    time.sleep(0.8)
    gone = client.get(AZ_EVENTS, headers=AZ).json()
    assert gone["Events"] == [] and gone["DocumentIncarnation"] == before + 2
    bad = client.post(AZ_EVENTS, headers=AZ, content=b"{\"Start\": 1}")
    assert bad.status_code == 400


def test_azure_event_starts_at_not_before(start):
    sim, client = start("azure", started_linger=30)
    sim.schedule("Reboot", deadline_seconds=0.5)
    assert client.get(AZ_EVENTS, headers=AZ).json()["Events"][0]["EventStatus"] == "Scheduled"
    time.sleep(0.7)
    assert client.get(AZ_EVENTS, headers=AZ).json()["Events"][0]["EventStatus"] == "Started"


def test_azure_vm_name_and_slow_first_call(start):
    _, client = start("azure", vm_name="trainer-3", first_call_delay=0.5)
    name = client.get("/metadata/instance/compute/name?api-version=2021-02-01&format=text", headers=AZ)
    assert (name.status_code, name.text) == (200, "trainer-3")
    began = time.monotonic()
    client.get(AZ_EVENTS, headers=AZ)
    first = time.monotonic() - began
    began = time.monotonic()
    client.get(AZ_EVENTS, headers=AZ)
    assert first >= 0.5 and time.monotonic() - began < 0.35


# ------------------------------------------------------------------------ Alibaba


def test_alibaba_hardened_mode(start):
    sim, client = start("alibaba")
    assert client.get(ALI_TERM).status_code == 403
    assert client.get(ALI_TERM, headers={ALI_TOKEN: "forged"}).status_code == 401
    assert client.put("/latest/api/token", headers={ALI_TTL: "0"}).status_code == 400
    token = client.put("/latest/api/token", headers={ALI_TTL: "60"}).text
    headers = {ALI_TOKEN: token}
    assert client.get(ALI_TERM, headers=headers).status_code == 404
    event = sim.schedule("terminate")
    resp = client.get(ALI_TERM, headers=headers)
    assert resp.status_code == 200 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", resp.text)
    assert abs(parse_time(resp.text).timestamp() - event["deadline"]) < 1
    assert event["deadline"] - event["flipped_at"] == pytest.approx(300)
    sim.expire_tokens()
    assert client.get(ALI_TERM, headers=headers).status_code == 401


def test_alibaba_normal_mode_serves_without_token(start):
    sim, client = start("alibaba", hardened=False)
    assert client.get(ALI_TERM).status_code == 404
    sim.schedule("terminate", deadline_seconds=60)
    assert client.get(ALI_TERM).status_code == 200


# ------------------------------------------------------------------------ control API


def test_control_schedule_flips_on_a_timer(start):
    sim, client = start("alibaba", hardened=False)
    resp = client.post("/_sim/schedule", json={"kind": "terminate", "in_seconds": 0.5, "deadline_seconds": 60})
    event = resp.json()
    assert resp.status_code == 200 and event["state"] == "pending" and event["flipped_at"] is None
    assert client.get(ALI_TERM).status_code == 404
    time.sleep(0.65)  # no request in between: the flip must not wait for one
    [flipped] = client.get("/_sim/state").json()["events"]
    assert flipped["state"] == "active" and abs(flipped["flipped_at"] - event["flip_at"]) < 0.1
    assert flipped["deadline"] == pytest.approx(event["flip_at"] + 60)


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/_sim/schedule", {"kind": "explode"}, 400),
    ("POST", "/_sim/schedule", {}, 400),
    ("POST", "/_sim/schedule", {"kind": "terminate", "in_seconds": -1}, 400),
    ("POST", "/_sim/schedule", {"kind": "terminate", "colour": "red"}, 400),
    ("POST", "/_sim/cancel", {"id": "nope"}, 400),
    ("POST", "/_sim/fault", {"mode": "explode"}, 400),
    ("POST", "/_sim/fault", {"mode": "500", "count": 0}, 400),
    ("POST", "/_sim/clear", {"what": "everything"}, 400),
    ("GET", "/_sim/schedule", None, 405),
    ("GET", "/_sim/nothing", None, 404),
])
def test_control_rejects_bad_calls(start, method, path, body, status):
    _, client = start("aws")
    resp = client.request(method, path, json=body)
    assert resp.status_code == status and "error" in resp.json()


def test_control_cancel_all_clear_and_counts(start):
    sim, client = start("aws", imdsv1=True)
    sim.schedule("terminate")
    sim.schedule("rebalance", in_seconds=30)
    client.get(SPOT)
    client.get(SPOT)
    assert len(client.post("/_sim/cancel", json={}).json()["cancelled"]) == 2
    assert client.get(SPOT).status_code == 404
    client.post("/_sim/fault", json={"mode": "503"})
    assert client.post("/_sim/clear", json={}).json() == {"cleared": "all"}
    state = client.get("/_sim/state").json()
    assert state["events"] == [] and state["faults"] == []
    assert state["requests"]["by_path"] == {f"GET {SPOT}": 3} and state["requests"]["total"] == 3
    assert client.post("/_sim/schedule", content=b"{not json").status_code == 400


# ------------------------------------------------------------------------ faults


@pytest.mark.parametrize("mode", ["500", "503", "429", "401"])
def test_fault_status_for_the_next_n_requests(start, mode):
    sim, client = start("aws", imdsv1=True)
    sim.fault(mode, count=2)
    statuses = [client.get(SPOT) for _ in range(3)]
    assert [r.status_code for r in statuses] == [int(mode), int(mode), 404]
    assert ("Retry-After" in statuses[0].headers) == (mode == "429")
    assert client.get("/_sim/state").status_code == 200  # the control API is never faulted
    assert sim.state()["requests"]["faulted"] == 2


def test_fault_for_some_seconds(start):
    sim, client = start("gcp")
    sim.fault("503", seconds=0.5)
    assert client.get("/computeMetadata/v1/instance/preempted", headers=GCP).status_code == 503
    time.sleep(0.55)
    assert client.get("/computeMetadata/v1/instance/preempted", headers=GCP).status_code == 200


def test_fault_slow_delays_then_answers(start):
    sim, client = start("gcp")
    sim.fault("slow", count=1, delay=0.3)
    began = time.monotonic()
    resp = client.get("/computeMetadata/v1/instance/preempted", headers=GCP)
    assert resp.text == "FALSE" and time.monotonic() - began >= 0.3


def test_fault_garbage_truncated_reset(start):
    sim, client = start("aws", imdsv1=True)
    sim.schedule("terminate")
    sim.fault("garbage", count=1)
    garbage = client.get(SPOT)
    assert garbage.status_code == 200
    with pytest.raises(ValueError):
        json.loads(garbage.content)
    sim.fault("truncated", count=1)
    with pytest.raises(httpx.RemoteProtocolError):
        client.get(SPOT)
    sim.fault("reset", count=1)
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        client.get(SPOT)
    assert client.get(SPOT).json()["action"] == "terminate"  # and then it recovers


def _get_in_thread(url: str, headers: dict[str, str]) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        began = time.monotonic()
        try:
            outcome["status"] = httpx.get(url, headers=headers, timeout=30).status_code
        except httpx.HTTPError as exc:
            outcome["error"] = type(exc).__name__
        outcome["seconds"] = time.monotonic() - began

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_fault_hang_ends_when_cleared(start):
    sim, client = start("aws", imdsv1=True)
    sim.fault("hang")
    thread, outcome = _get_in_thread(sim.url + SPOT, {})
    time.sleep(0.3)
    assert thread.is_alive()
    client.post("/_sim/clear", json={"what": "faults"})
    thread.join(timeout=2)
    assert not thread.is_alive() and "error" in outcome and outcome["seconds"] < 1.5
    assert client.get(SPOT).status_code == 404


@pytest.mark.parametrize("hanging", ["fault", "long-poll"])
def test_stop_closes_hanging_requests_promptly(start, hanging):
    sim, _ = start("gcp")
    if hanging == "fault":
        sim.fault("hang")
    thread, outcome = _get_in_thread(
        sim.url + "/computeMetadata/v1/instance/preempted?wait_for_change=true&timeout_sec=30", GCP)
    time.sleep(0.3)
    assert thread.is_alive()
    began = time.monotonic()
    sim.stop()
    thread.join(timeout=2)
    assert time.monotonic() - began < 1 and not thread.is_alive() and outcome["seconds"] < 1.5
    with pytest.raises(httpx.ConnectError):
        httpx.get(sim.url + "/computeMetadata/v1/instance/preempted", headers=GCP, timeout=2)


# ------------------------------------------------------------------------ entry points


def test_python_dash_m_subprocess(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "spotguard_daemon.simulator", "aws", "--port", "0",
                             "-o", "imdsv1=true"], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        match = re.match(r"spotguard simulator aws listening on (http://127\.0\.0\.1:\d+) "
                         r"\(control API: \1/_sim/\)$", line.strip())
        assert match, line
        url = match.group(1)
        httpx.post(url + "/_sim/schedule", json={"kind": "stop"}, timeout=5)
        assert httpx.get(url + SPOT, timeout=5).json()["action"] == "stop"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()
        proc.wait()


def test_python_dash_m_rejects_bad_options():
    result = subprocess.run([sys.executable, "-m", "spotguard_daemon.simulator", "azure", "--port", "0",
                             "-o", "no_such_option=1"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "no_such_option" in result.stderr


def test_parse_option_and_unknown_platform():
    assert parse_option("vm-name=vm-3") == ("vm_name", "vm-3")
    assert parse_option("imdsv1=true") == ("imdsv1", True)
    assert parse_option("first_call_delay=2.5") == ("first_call_delay", 2.5)
    with pytest.raises(ValueError):
        parse_option("novalue")
    with pytest.raises(ValueError):
        Simulator("oracle")
