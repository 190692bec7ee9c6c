"""Goodput figures from the Hugging Face ``Trainer`` callback, as a real daemon counts them.

The user-style job of ``tests/client/_integration_jobs.py`` (the Trainer saving every 4 steps) talks
to a real daemon: it is SIGKILLed at step 10 once the daemon acknowledged its progress there, and the
identical command resumes from ``checkpoint-8``. The daemon must have received its progress reports
and count the restart and the 2 steps lost (9 and 10).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_goodput_loss import progress_requests
from test_goodput_metrics import samples

pytest.importorskip("transformers", reason="needs transformers (extra: hf)")

JOB = Path(__file__).parents[1] / "client" / "_integration_jobs.py"


def launch(daemon, out: Path, **knobs: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    env.update(knobs, JOB_DAEMON="1", OMP_NUM_THREADS="1", SPOTGUARD_RUNTIME_DIR=str(daemon.runtime_dir),
               SPOTGUARD_PROGRESS_SECONDS="0.01")
    return subprocess.run([sys.executable, str(JOB), "hf", str(out)], env=env, timeout=240,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_the_hf_callback_reports_its_progress_and_resume(daemon_factory, tmp_path):
    daemon, out = daemon_factory(), tmp_path / "out"
    killed = launch(daemon, out, JOB_KILL="10")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    assert progress_requests(daemon) >= 1
    assert (out / "checkpoint-8").is_dir() and not (out / "checkpoint-12").exists()
    again = launch(daemon, out)
    assert again.returncode == 0, again.stdout[-3000:]
    values = samples(daemon)
    assert values["spotguard_job_restarts_total"] == 1  # resumed from checkpoint-8
    assert values["spotguard_steps_lost_total"] == 2  # steps 9 and 10, trained again
    assert values["spotguard_training_seconds_total"] > 0
