"""Goodput figures from the Hugging Face and Lightning callbacks, as a real daemon counts them.

The user-style jobs of ``tests/client/_integration_jobs.py`` (saving every 4 steps) talk to a real
daemon: each is SIGKILLed at step 10 once the daemon acknowledged its progress there, and the
identical command resumes from step 8. The daemon must have received its progress reports
and count the restart and the 2 steps lost (9 and 10), under the tier ``local``.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_goodput_loss import progress_requests
from test_goodput_metrics import samples, tiers

JOB = Path(__file__).parents[1] / "client" / "_integration_jobs.py"
sys.path.append(str(JOB.parent))
from _jobserver import JobServer  # noqa: E402 (tests/client)

_SERVER: list[JobServer] = []


def run_job(kind: str, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``_integration_jobs.py kind out`` to its end, as a process forked by a JobServer that imported
    torch, Lightning and transformers once (a fresh interpreter spends 7-9 s importing them); its
    status (-9 when SIGKILLed) and merged output."""
    if not _SERVER:
        _SERVER.append(JobServer(("lightning.pytorch", "transformers.trainer")))
        atexit.register(_SERVER[0].close)
    fd, log = tempfile.mkstemp(prefix="sg-job-", suffix=".out")
    os.close(fd)
    try:
        code = _SERVER[0].run([str(JOB), kind, str(out)], env, Path(log))
        return subprocess.CompletedProcess([str(JOB), kind, str(out)], code, Path(log).read_text())
    finally:
        os.unlink(log)


def launch(kind: str, daemon, out: Path, **knobs: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    env.update(knobs, JOB_DAEMON="1", OMP_NUM_THREADS="1", SPOTGUARD_RUNTIME_DIR=str(daemon.runtime_dir),
               SPOTGUARD_PROGRESS_SECONDS="0.01")
    return run_job(kind, out, env)


@pytest.mark.slow
@pytest.mark.timeout(240)  # two framework jobs: about 15 s each on an idle machine
@pytest.mark.parametrize("kind", ["hf", "lightning"])
def test_the_callbacks_report_their_progress_and_resume(daemon_factory, tmp_path, kind):
    pytest.importorskip({"hf": "transformers", "lightning": "lightning.pytorch"}[kind])
    daemon, out = daemon_factory(), tmp_path / "out"
    killed = launch(kind, daemon, out, JOB_KILL="10")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    assert progress_requests(daemon) >= 1
    again = launch(kind, daemon, out)
    assert again.returncode == 0, again.stdout[-3000:]
    values = samples(daemon)
    assert values["spotguard_job_restarts_total"] == 1  # resumed from step 8
    assert values["spotguard_steps_lost_total"] == 2  # steps 9 and 10, trained again
    assert tiers(daemon, "spotguard_steps_lost_total")["local"] == 2  # step 8 was on this node's disk
    assert values["spotguard_training_seconds_total"] > 0
