"""The learned cadence end to end: real daemons, a real job, preemptions through the manual notice.

A job (``cadence_job.py``, a ``Run`` on its default Young/Daly cadence) is preempted twice on node A
by a manual ``preempt`` notice; node A then goes away with the job's third life, and the job is
relaunched on node B (its own state, the same bucket). Each relaunch is one more interruption; node
B learns the first ones from the job's record in the bucket. The job must plan with the MTBF the
daemon learned (``learned_mtbf`` over the configured prior, counting 3 interruptions and the
running time of its lives), which ``spotguard cadence --job`` and the metrics show too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from spotguard import cadence as cad
from spotguard.protocol import CadenceRequest, Kind, NotifyRequest, StatusRequest

from test_goodput_fresh_node import node_b, wait_for  # noqa: F401 (node_b is a fixture)


def job_gauge(daemon, name: str, job: str = "cadence-e2e") -> float:
    text = httpx.get(daemon.request(StatusRequest()).data["metrics"], timeout=5).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and s.labels == {"job": job})


JOB = Path(__file__).with_name("cadence_job.py")
PRIOR_S = 60.0
SETTINGS = {"SPOTGUARD_CADENCE__NODE_MTBF_HOURS": str(PRIOR_S / 3600),
            "SPOTGUARD_CADENCE__MIN_MTBF_SECONDS": "1", "SPOTGUARD_STORAGE__PROGRESS_SECONDS": "0.2"}


def life(daemon, root: Path, ready: Path, expect: int, *args: str, handled: list[str] = ()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(SPOTGUARD_RUNTIME_DIR=str(daemon.runtime_dir), SPOTGUARD_PROGRESS_SECONDS="0.05",
               SPOTGUARD_HANDLED_NOTICES=",".join(handled))
    ready.unlink(missing_ok=True)
    return subprocess.Popen([sys.executable, str(JOB), str(root), "--ready", str(ready), "--expect",
                             str(expect), *args], env=env)


def until_ready(job: subprocess.Popen, ready: Path, daemon) -> dict:
    wait_for(lambda: ready.exists() or job.poll() is not None, "the job's report", 90)
    assert ready.exists(), f"the job exited {job.returncode} first: {daemon.output()[-3000:]}"
    return json.loads(ready.read_text())


def preempt(daemon, job: subprocess.Popen) -> str:
    reply = daemon.request(NotifyRequest(kind=Kind.PREEMPT, deadline_seconds=20, detail="cadence test"))
    assert reply.ok, reply.error
    assert job.wait(60) == 75
    return reply.data["notice"]["id"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_job_plans_with_the_mtbf_learned_from_its_preemptions_on_every_node(daemon_factory, node_b,  # noqa: F811
                                                                              tmp_path):
    bucket, ready = tmp_path / "bucket", tmp_path / "ready.json"
    env = {"SPOTGUARD_STORAGE__URL": f"file://{bucket}", **SETTINGS}
    node_a = daemon_factory(env=env)
    root, handled, lives = node_a.checkpoint_root / "job", [], []
    began = time.monotonic()
    for expect in range(3):
        job = life(node_a, root, ready, expect, handled=handled)
        try:
            lives.append(until_ready(job, ready, node_a))
            if expect < 2:
                handled.append(preempt(node_a, job))
            else:
                wait_for(lambda: json.loads((bucket / "jobs" / "cadence-e2e" / "progress.json").read_text())
                         .get("interruptions") == 2, "the third life's record in the bucket")
        finally:
            job.kill()  # the third life: node A is reclaimed without a word
            job.wait(10)
    node_a.kill()
    first = lives[0]
    assert first["rate"]["interruptions"] == 0 and first["source"] == "learned"
    assert lives[1]["rate"]["interruptions"] == 1 and lives[2]["rate"]["interruptions"] == 2

    fresh = node_b(env)
    job = life(fresh, fresh.checkpoint_root / "job", ready, 3, "--finish")
    last = until_ready(job, ready, fresh)
    assert job.wait(60) == 0, fresh.output()[-3000:]
    elapsed = time.monotonic() - began

    rate = last["rate"]
    assert rate["interruptions"] == 3 and rate["nodes"] == 1 and rate["job_id"] == "cadence-e2e"
    assert rate["prior_mtbf_s"] == pytest.approx(PRIOR_S) and rate["floor_s"] == 1
    assert 3.0 < rate["running_s"] < elapsed  # each life ran more than a second before its report
    assert rate["mtbf_s"] == pytest.approx(cad.learned_mtbf(PRIOR_S, 3, rate["running_s"], floor_s=1))
    assert rate["mtbf_s"] < PRIOR_S / 2  # three interruptions in well under three minutes
    assert last["source"] == "learned" and last["mtbf_s"] == rate["mtbf_s"]
    assert last["interval_s"] == pytest.approx(max(cad.daly_interval(rate["mtbf_s"], last["cost_s"]), last["floor_s"]))

    known = fresh.request(CadenceRequest(job_id="cadence-e2e")).data["rate"]
    assert known["interruptions"] == 3 and known["running_s"] >= rate["running_s"]
    assert fresh.request(CadenceRequest(job_id="no-such-job")).data["rate"] is None
    assert job_gauge(fresh, "spotguard_job_mtbf_seconds") == pytest.approx(
        cad.learned_mtbf(PRIOR_S, 3, known["running_s"], floor_s=1), rel=0.01)  # running_s goes on
    assert job_gauge(fresh, "spotguard_job_interruptions") == 3
    shown = subprocess.run([sys.executable, "-m", "spotguard_daemon", "cadence", "--job", "cadence-e2e",
                            "--checkpoint-seconds", "2"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "SPOTGUARD_RUNTIME_DIR": str(fresh.runtime_dir)})
    assert shown.returncode == 0, shown.stderr
    assert "3 interruptions" in shown.stdout and "learned by the daemon" in shown.stdout
