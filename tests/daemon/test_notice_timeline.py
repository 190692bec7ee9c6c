"""The notice timeline through a real daemon subprocess: a real ``spotguard.Run`` job stopped by a drill
notice, a notice that finds no client, one whose client never gets safe, and a node stop.

Each test reads what an operator reads: ``spotguard status`` and ``spotguard notices`` (the
commands, as subprocesses), ``/metrics`` and the job's run record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from spotguard import _record
from spotguard.protocol import Kind, NotifyRequest, StatusRequest

HERE = Path(__file__).resolve().parent


def cli(daemon, *args: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir)}
    return subprocess.run([sys.executable, "-m", "spotguard_daemon", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def metrics(daemon) -> dict[tuple[str, tuple], float]:
    text = httpx.get(daemon.request(StatusRequest()).data["metrics"], timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for(what, seconds: float = 60.0, step: float = 0.1):
    """Poll ``what()`` until it returns something true; that value."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"not true within {seconds} s: {what}")


def timeline(daemon, outcome: str | None = None, stage: str | None = None) -> dict | None:
    """``spotguard status --json``'s current timeline once it has ``outcome`` and ``stage``."""
    result = cli(daemon, "status", "--json")
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout).get("timeline")
    if line is None or (outcome and line["outcome"] != outcome):
        return None
    if stage and stage not in [s["stage"] for s in line["stages"]]:
        return None
    return line


def stopped_by(job: subprocess.Popen, notify) -> None:
    """Call ``notify()`` (it waits for its moment and sends the notice); the job must exit 75. The job
    is killed on any failure."""
    try:
        notify()
        assert job.wait(60) == 75, job.stdout.read()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)


def at(stage: dict) -> datetime:
    return datetime.fromisoformat(stage["at"])


@pytest.mark.slow
def test_a_drill_through_the_real_daemon_shows_every_stage_in_order(daemon_factory, tmp_path):
    daemon = daemon_factory()
    record = tmp_path / "record.jsonl"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir), "SPOTGUARD_RECORD": str(record)}
    job = subprocess.Popen([sys.executable, str(HERE / "timeline_job.py"), str(daemon.checkpoint_root / "job")],
                           env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def notify():
        wait_for(lambda: any(c["pid"] == job.pid for c in daemon.request(StatusRequest()).data["clients"])
                 and any(e["event"] == "progress" and e["step"] >= 5 for e in _record.read(record)))
        notified = cli(daemon, "notify", "--kind", "drill", "--deadline", "60")
        assert notified.returncode == 0, notified.stderr

    stopped_by(job, notify)
    line = wait_for(lambda: timeline(daemon, "saved", "durable"))
    stages = {s["stage"]: s for s in line["stages"]}
    order = ["seen", "published", "flagged", "stopped", "committed", "safe", "durable"]
    assert all(name in stages for name in order + ["signalled"]), [(s["stage"], s.get("pid")) for s in line["stages"]]
    assert at(stages["published"]) <= at(stages["signalled"]) <= at(stages["stopped"])  # the PUB came first
    times = [at(stages[name]) for name in order]
    assert times == sorted(times), [(n, stages[n]["at"]) for n in order]
    assert all(0 <= stages[name]["after_s"] < 60 for name in order)
    assert stages["seen"]["after_s"] == 0
    for name in ("flagged", "stopped", "committed", "safe"):
        assert stages[name]["pid"] == job.pid
    assert stages["committed"]["step"] == stages["stopped"]["step"] == stages["durable"]["step"]
    assert stages["committed"]["estimate_s"] > 0 and 0 < stages["committed"]["seconds_left"] <= 60
    assert job.pid in stages["signalled"]["pids"]
    assert line["kind"] == "drill" and line["clients_at_seen"] == 1 and line["waiting_for_durable"] == []

    human = cli(daemon, "status")
    assert human.returncode == 0 and f"notice {line['id']}" in human.stdout and "saved" in human.stdout
    assert "committed" in human.stdout and f"pid {job.pid}" in human.stdout, human.stdout
    history = cli(daemon, "notices", "--json")
    assert history.returncode == 0, history.stderr
    assert json.loads(history.stdout)[0]["id"] == line["id"]
    listed = cli(daemon, "notices")
    assert line["id"] in listed.stdout and "saved" in listed.stdout

    values = metrics(daemon)
    for name in order[1:] + ["signalled"]:
        assert values[("spotguard_notice_stage_seconds_count", (("stage", name),))] == 1, name
    assert values[("spotguard_notice_outcomes_total", (("outcome", "saved"),))] == 1
    assert values[("spotguard_notice_outcomes_total", (("outcome", "missed_deadline"),))] == 0
    assert values[("spotguard_notices_without_client_streak", ())] == 0

    stop = [e for e in _record.read(record) if e["event"] == "stop"][-1]
    assert stop["save"] == "committed" and stop["estimate_s"] > 0
    assert stop["flagged_t"] <= stop["stopped_t"] <= stop["committed_t"] <= stop["safe_t"]
    assert abs(stop["committed_t"] - at(stages["committed"]).timestamp()) < 1e-3


def test_notices_that_find_no_client_are_counted_in_a_streak(daemon_factory):
    daemon = daemon_factory()
    ids = [daemon.request(NotifyRequest(kind=Kind.DRILL, deadline_seconds=0.5)).data["notice"]["id"]
           for _ in range(3)]
    wait_for(lambda: metrics(daemon)[("spotguard_notice_outcomes_total", (("outcome", "no_client"),))] == 3)
    assert metrics(daemon)[("spotguard_notices_without_client_streak", ())] == 3
    listed = json.loads(cli(daemon, "notices", "--json").stdout)
    assert sorted(t["id"] for t in listed) == sorted(ids)
    assert all(t["outcome"] == "no_client" and t["clients_at_seen"] == 0 for t in listed)
    assert all(not any("pid" in s for s in t["stages"]) for t in listed)


CLIENT = """
import sys, time
import spotguard
guard = spotguard.Guard(job_id="idle")
print("ready", flush=True)
while not guard.stop_requested:
    time.sleep(0.01)
time.sleep(60)  # never saves, never reports safe: killed by the test
"""


def test_a_client_that_never_gets_safe_misses_the_deadline(daemon_factory):
    daemon = daemon_factory("--log-level", "DEBUG")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir), "SPOTGUARD_DELIVERY__SIGNAL": "none"}
    client = subprocess.Popen([sys.executable, "-c", CLIENT], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "ready"
        wait_for(lambda: daemon.request(StatusRequest()).data["clients"])
        daemon.request(NotifyRequest(kind=Kind.DRILL, deadline_seconds=2))
        line = wait_for(lambda: timeline(daemon, "missed_deadline"))
    finally:
        client.kill()
        client.wait(10)
    stages = [s["stage"] for s in line["stages"]]
    assert stages[:2] == ["seen", "published"] and "flagged" in stages and "safe" not in stages
    flagged = next(s for s in line["stages"] if s["stage"] == "flagged")
    assert flagged["pid"] == client.pid and flagged["after_s"] < 2  # the guard's ack, before the deadline
    values = metrics(daemon)
    assert values[("spotguard_notice_outcomes_total", (("outcome", "missed_deadline"),))] == 1
    assert values[("spotguard_notices_without_client_streak", ())] == 0


def test_a_node_stop_marks_the_open_notice_gone_and_the_history_survives_a_restart(daemon_factory):
    daemon = daemon_factory()
    notice = daemon.request(NotifyRequest(kind=Kind.DRILL, deadline_seconds=300)).data["notice"]["id"]
    assert daemon.stop(signal.SIGTERM) == 0  # outside systemd a SIGTERM means the node is going
    again = daemon_factory()
    assert again.state_dir == daemon.state_dir
    listed = json.loads(cli(again, "notices", "--json").stdout)
    by_id = {t["id"]: t for t in listed}
    assert "gone" in [s["stage"] for s in by_id[notice]["stages"]]  # then published again, restored
    assert not [t for t in listed if t["kind"] == "signal"]  # no client to warn: the stop raised none
    mode = (again.state_dir / "timelines.json").stat().st_mode & 0o777
    assert mode == 0o600


@pytest.mark.slow
def test_a_hugging_face_job_stopped_during_an_evaluation_reports_its_step_and_save(daemon_factory, tmp_path):
    """The Trainer callback's side of the timeline: the step it stopped at and the save committed
    (a drill notice during the evaluation after step 8: that step is saved at once), in status, the
    history and the run record."""
    daemon = daemon_factory()
    record = tmp_path / "record.jsonl"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}, "OMP_NUM_THREADS": "1",
           "SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir), "SPOTGUARD_RECORD": str(record)}
    job = subprocess.Popen([sys.executable, str(HERE.parent / "client" / "_hf_eval_job.py"),
                            str(daemon.checkpoint_root / "hf")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)

    def notify():
        next(out for out in job.stdout if out.strip() == "evaluating 8")
        daemon.request(NotifyRequest(kind=Kind.DRILL, deadline_seconds=60))

    stopped_by(job, notify)
    line = wait_for(lambda: timeline(daemon, "saved", "safe"))
    stages = {s["stage"]: s for s in line["stages"]}
    step = stages["stopped"]["step"]  # 8; 9 if flagged after the 1.2 s evaluation
    assert step in (8, 9) and stages["committed"]["step"] == step, line["stages"]
    assert stages["committed"]["pid"] == stages["safe"]["pid"] == job.pid
    assert stages["committed"]["estimate_s"] > 0 and 0 < stages["committed"]["seconds_left"] <= 60
    listed = json.loads(cli(daemon, "notices", "--json").stdout)
    assert listed[0]["id"] == line["id"] and listed[0]["outcome"] == "saved"
    stop = [e for e in _record.read(record) if e["event"] == "stop"][-1]
    assert stop["step"] == step and stop["save"] == "committed" and stop["notice"]["kind"] == "drill"
    assert stop["flagged_t"] <= stop["stopped_t"] <= stop["committed_t"] <= stop["safe_t"]
