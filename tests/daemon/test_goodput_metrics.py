"""Goodput metrics of a real daemon subprocess: restarts, committed steps re-run, save time.

The job is a real :class:`spotguard.Run` that commits through the daemon, loses its newest local
checkpoint (the daemon's store restores it) and is relaunched; then the same figures over raw protocol requests,
and a rank-1 or plain (not resumed) registration that must count nothing. Each restart is counted
under the tier its client named (``resumed_tier``), ``unknown`` for a client that named none; a tier
the protocol does not know is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import datetime, timezone

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from spotguard import Run
from spotguard.guard import Guard
from spotguard.protocol import CommitRequest, ProgressRequest, RegisterRequest, StatusRequest


def scrape(daemon) -> list:
    url = daemon.request(StatusRequest()).data["metrics"]
    text = httpx.get(url, timeout=5).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def samples(daemon) -> dict[str, float]:
    """The unlabelled samples, a histogram's +Inf bucket, and the per-restart figures summed over
    their ``tier`` label (:func:`tiers` has them per tier)."""
    values: dict[str, float] = {}
    for s in scrape(daemon):
        if not s.labels or set(s.labels) == {"tier"} or set(s.labels) == {"le"} and s.labels["le"] == "+Inf":
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


ZERO = dict.fromkeys(("local", "peer", "bucket", "unknown"), 0.0)
"""Every tier a per-restart figure is exposed under, at zero (each series exists from the start)."""


def tiers(daemon, name: str) -> dict[str, float]:
    """Tier -> the value of the per-restart figure ``name`` (a sample name, ``..._total``)."""
    return {s.labels["tier"]: s.value for s in scrape(daemon) if s.name == name and set(s.labels) == {"tier"}}


def run_steps(root, total: int) -> Run:
    model = torch.nn.Linear(2, 1)
    run = Run(root, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), save_every=2,
              job_id="goodput", exit_on_stop=False)
    for _ in run.steps(total):
        pass
    run.finish()
    return run


@pytest.fixture
def daemon(daemon_factory, monkeypatch):
    daemon = daemon_factory()
    for key in [k for k in os.environ if k.startswith("SPOTGUARD_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SPOTGUARD_RUNTIME_DIR", str(daemon.runtime_dir))
    return daemon


def test_a_relaunched_run_counts_a_restart_and_the_committed_steps_it_reruns(daemon):
    root = daemon.checkpoint_root / "job"
    run_steps(root, 6)  # commits steps 2, 4, 6
    before = samples(daemon)
    assert before["spotguard_job_restarts_total"] == 0
    assert before["spotguard_checkpoint_save_seconds_count"] >= 3
    for _ in range(150):  # the daemon uploads in the background: wait until step 6 is durable
        if samples(daemon).get("spotguard_upload_last_durable_step") == 6:
            break
        time.sleep(0.2)
    shutil.rmtree(root / "step-0000000006")  # lost with the node; the daemon's store still has it
    assert run_steps(root, 8).start_step == 6
    after = samples(daemon)
    assert after["spotguard_job_restarts_total"] == 1
    assert after["spotguard_steps_redone_total"] == 0  # nothing committed was re-run
    assert after["spotguard_checkpoint_save_seconds_count"] == before["spotguard_checkpoint_save_seconds_count"] + 1


def commit(daemon, job: str, step: int, seconds: float):
    path = daemon.checkpoint_root / job / f"step-{step:010d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"step": step}))
    return daemon.request(CommitRequest(pid=os.getpid(), job_id=job, path=str(path), step=step,
                                        save_seconds=seconds))


def test_protocol_requests_feed_the_goodput_metrics(daemon):
    pid = os.getpid()
    assert daemon.request(RegisterRequest(pid=pid, job_id="a")).ok
    assert commit(daemon, "a", 10, 0.5).ok and commit(daemon, "a", 30, 1.5).ok
    assert daemon.request(RegisterRequest(pid=pid, job_id="a", rank=1, resumed_from_step=10)).ok
    assert daemon.request(RegisterRequest(pid=pid, job_id="b", resumed_from_step=7)).ok  # no commit seen
    assert daemon.request(RegisterRequest(pid=pid, job_id="a", resumed_from_step=10)).ok
    values = samples(daemon)
    assert values["spotguard_job_restarts_total"] == 2  # rank 1 is not counted
    assert values["spotguard_steps_redone_total"] == 20
    assert values["spotguard_checkpoint_save_seconds_count"] == 2
    assert values["spotguard_checkpoint_save_seconds_sum"] == 2.0


def test_out_of_bounds_goodput_fields_are_refused(daemon):
    reply = daemon.request(RegisterRequest.model_construct(pid=os.getpid(), resumed_from_step=-1))
    assert not reply.ok and "resumed_from_step" in reply.error
    assert samples(daemon)["spotguard_job_restarts_total"] == 0


def test_a_commit_stamped_with_a_naive_or_unparsable_time_is_refused_and_loses_nothing(daemon):
    path = daemon.checkpoint_root / "n" / f"step-{3:010d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"step": 3}))
    good = {"v": 1, "type": "commit", "pid": os.getpid(), "job_id": "n", "path": str(path), "step": 3}
    for stamp in ("2026-01-01T00:00:00", "yesterday", "2026-13-01T00:00:00Z"):
        reply = daemon.request(json.dumps({**good, "reached_at": stamp}).encode())
        assert not reply.ok and "reached_at" in reply.error, stamp
    assert daemon.request(json.dumps({**good, "reached_at": "2026-01-01T00:00:00Z"}).encode()).ok  # too old: unused


def report(daemon, job: str, step: int) -> None:
    assert daemon.request(ProgressRequest(pid=os.getpid(), job_id=job, step=step,
                                          at=datetime.now(timezone.utc))).ok


def test_a_restart_counts_its_loss_under_the_tier_its_client_named(daemon):
    report(daemon, "from-peer", 5)
    report(daemon, "old-client", 9)
    endpoints = {"pub_endpoint": daemon.pub_endpoint, "request_endpoint": daemon.request_endpoint}
    with Guard(job_id="from-peer", rank=0, force_exit=False, **endpoints) as guard:
        assert guard.report_resume(2, "peer")  # steps 3, 4 and 5 trained again
    old = {"v": 1, "type": "register", "pid": os.getpid(), "job_id": "old-client", "resumed_from_step": 5}
    assert daemon.request(json.dumps(old).encode()).ok  # an older client: no resumed_tier at all
    assert tiers(daemon, "spotguard_job_restarts_total") == {**ZERO, "peer": 1, "unknown": 1}
    assert tiers(daemon, "spotguard_steps_lost_total") == {**ZERO, "peer": 3, "unknown": 4}
    assert set(tiers(daemon, "spotguard_time_lost_seconds_total")) == set(ZERO)
    assert set(tiers(daemon, "spotguard_downtime_seconds_total")) == set(ZERO)
    assert samples(daemon)["spotguard_steps_lost_total"] == 7  # the sum over the tiers


def test_a_tier_the_protocol_does_not_know_is_refused_and_counts_nothing(daemon):
    with pytest.raises(ValidationError, match="resumed_tier"):
        RegisterRequest(pid=os.getpid(), resumed_from_step=3, resumed_tier="disk")
    report(daemon, "j", 5)
    bad = {"v": 1, "type": "register", "pid": os.getpid(), "job_id": "j", "resumed_from_step": 3}
    for tier in ("disk", "", "PEER", 1, ["peer"]):
        reply = daemon.request(json.dumps({**bad, "resumed_tier": tier}).encode())
        assert not reply.ok and "resumed_tier: Input should be 'local', 'peer' or 'bucket'" in reply.error, tier
    assert samples(daemon)["spotguard_job_restarts_total"] == 0
    assert samples(daemon)["spotguard_steps_lost_total"] == 0
    assert daemon.request(RegisterRequest(pid=os.getpid(), job_id="j", resumed_from_step=3,
                                          resumed_tier="local")).ok
    assert tiers(daemon, "spotguard_steps_lost_total")["local"] == 2
