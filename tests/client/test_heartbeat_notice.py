"""A notice during an evaluation in a job of several ranks, agreed at ``run.heartbeat()``
(``Run(agree_at_heartbeat=True)``, :mod:`spotguard._heartbeat`), with torchrun, gloo and DDP.

Rank 1 alone gets SIGTERM 20 batches into the evaluation after step 7 (index; 8 steps done). Both
ranks agree at a heartbeat, save step 8 (not at the next boundary: the evaluation never ends),
exit 75, and the relaunch ends on the uninterrupted run's digest: the evaluation's RNG draws never
reach training, and the save holds the RNG and loader position of step 8's end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.checkpoint import Checkpointer

JOB = Path(__file__).with_name("_heartbeat_job.py")

pytestmark = pytest.mark.slow


def torchrun(out: Path, tmp: Path, job: Path = JOB, **knobs: str) -> tuple[int, str, dict[int, str]]:
    """Run the job on 2 ranks to its end; its status, output and each rank's exit status."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    env.update(knobs, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               SPOTGUARD_RUNTIME_DIR=str(tmp / "rt"))
    for exit_file in out.glob("exit.*"):
        exit_file.unlink()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts",
                             "0", "--nproc-per-node", "2", str(job), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            for pid in [proc.pid] + [int(p.read_text()) for p in out.glob("pid.*")]:
                try:
                    os.kill(pid, 9)
                except (ProcessLookupError, ValueError):
                    pass
            proc.wait(10)
    codes = {r: (out / f"exit.{r}").read_text() if (out / f"exit.{r}").exists() else "missing" for r in (0, 1)}
    return proc.returncode, text, codes


def digest_of(text: str) -> str:
    return re.findall(r"^DIGEST (\w+)$", text, re.M)[-1]


@pytest.mark.timeout(600)
def test_a_notice_to_one_rank_during_an_evaluation_stops_every_rank_at_a_heartbeat_with_that_step_saved(tmp_path):
    status, text, codes = torchrun(tmp_path / "reference", tmp_path)
    assert status == 0 and codes == {0: "0", 1: "0"}, text[-6000:]
    reference = digest_of(text)

    out = tmp_path / "stopped"
    status, text, codes = torchrun(out, tmp_path, JOB_SIGNAL_EVAL="7")
    assert codes == {0: "75", 1: "75"}, (codes, text[-6000:])
    assert (out / "signalled").exists()
    agreed = re.findall(r"^\[rank (\d)\] .*a stop agreed at run.heartbeat\(\) \d+, between steps: every rank "
                        r"saves step (\d+)$", text, re.M)
    assert sorted(agreed) == [("0", "8"), ("1", "8")], text[-6000:]
    assert "eval 7" in text and "evaluated 7" not in text  # stopped during the evaluation
    assert Checkpointer(out / "ckpt").latest().step == 8  # step 8's own save, not step 5's
    assert text.count("Traceback") == text.count("errors.ChildFailedError:"), text[-6000:]  # torchrun's own

    status, text, codes = torchrun(out, tmp_path)
    assert status == 0 and codes == {0: "0", 1: "0"}, text[-6000:]
    assert "resumed from step 8" in text and "eval 3" not in text
    assert digest_of(text) == reference
