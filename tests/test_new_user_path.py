"""The new user's path, start to finish, with no warning that is not about the user's own code.

README's "Make a training loop preemption-safe" filled in as a user would (a tiny model, a shuffled
``spotguard.DataLoader`` with two workers, dropout, AdamW, a scheduler) and driven through
docs/getting-started.md's "Your own job, beside a daemon": the node's daemon with a checkpoint
root, the job run plainly (fresh start), again under ``spotguard run`` (resumed) through a
``spotguard notify`` and its relaunch, then ``spotguard drill`` as docs/drill.md gives it (one
preemption: tests/daemon/test_drill_loader.py drills such a job with every kind).
``spotguard demo`` (the first steps of the README) is tests/test_demo.py's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard_daemon.commands.common import daemon_status

TRAIN = '''
import argparse
import time

import torch
from torch import nn

import spotguard

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--ckpt-dir", default="checkpoints")
parser.add_argument("--step-sleep", type=float, default=0.0)
args = parser.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
loader = spotguard.DataLoader(data, batch_size=16, shuffle=True, num_workers=2, seed=0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)


def batches():
    while True:
        yield from loader
        loader.sampler.set_epoch(loader.sampler.epoch + 1)


def train_step(step, batch):
    x, y = batch
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    time.sleep(args.step_sleep)
    return loss


run = spotguard.Run(args.ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                    loader=loader)
with run:
    for step, batch in zip(run.steps(args.steps), batches()):
        loss = train_step(step, batch)
'''

BAD = re.compile(r"Warning|WARNING|Traceback")


def no_warnings(output: str, what: str) -> None:
    """No line of ``output`` warns, unless it is about the user's own train.py."""
    bad = [line for line in output.splitlines() if BAD.search(line) and "train.py" not in line
           and " notice manual:" not in line]  # the notify or drill asked for: logged at WARNING
    assert not bad, f"{what} warned:\n" + "\n".join(bad) + "\n--- all of it:\n" + output


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_getting_started_run_and_drill_on_your_own_job(tmp_path, sock_dir):
    (tmp_path / "train.py").write_text(TRAIN)
    env = {**os.environ, "SPOTGUARD_RUNTIME_DIR": str(sock_dir / "run"),
           "SPOTGUARD_STATE_DIR": str(tmp_path / "state"), "PYTHONWARNINGS": "default"}
    env.pop("SPOTGUARD_RECORD", None)
    bin_dir = Path(sys.executable).parent
    spotguard = [str(bin_dir / "spotguard")] if (bin_dir / "spotguard").exists() else [
        sys.executable, "-m", "spotguard_daemon"]

    def sh(*argv: str, expect: int = 0, timeout: float = 120) -> str:
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)
        out = done.stdout + done.stderr
        assert done.returncode == expect, f"{argv}: exit {done.returncode}\n{out}"
        no_warnings(out, " ".join(argv))
        return out

    # getting-started: the node's daemon, with the job's checkpoint directory as its root
    with open(tmp_path / "daemon.log", "w") as log:
        daemon = subprocess.Popen(
            [*spotguard, "daemon", "--checkpoint-root", str(tmp_path / "checkpoints")],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    supervisor = None
    try:
        endpoint = f"ipc://{sock_dir}/run/requests.sock"
        deadline = time.monotonic() + 30
        while daemon_status(endpoint, timeout=1.0) is None:
            assert daemon.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "daemon.log").read_text()
            time.sleep(0.2)
        python = sys.executable
        out = sh(python, "train.py", "--steps", "20")
        assert "fresh start at step 0" in out, out

        # the identical command again, under spotguard run (its first launch resumes), through a
        # notice and its relaunch
        supervisor = subprocess.Popen(
            [*spotguard, "run", "--", python, "train.py", "--steps", "200", "--step-sleep", "0.05"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in supervisor.stdout:
            lines.append(line)
            if "resumed from step 20" in line:
                break
        time.sleep(1.0)
        sh(*spotguard, "notify", "--kind", "drill", "--deadline", "60")
        out = "".join(lines) + supervisor.stdout.read()
        assert supervisor.wait(timeout=120) == 0, out
        no_warnings(out, "spotguard run")
        assert "relaunching it" in out and "1 preemption(s)" in out, out
        assert "finished at step 200" in out, out
        sh(*spotguard, "status")
    finally:
        if supervisor is not None and supervisor.poll() is None:
            supervisor.kill()
        daemon.terminate()
        assert daemon.wait(timeout=30) == 0
    no_warnings((tmp_path / "daemon.log").read_text(), "the daemon")

    # docs/drill.md on the same job, in a checkpoint directory of its own
    start = time.monotonic()
    # --launch-timeout: a launch that hangs is reported by the drill (its step, its last lines)
    # well within the test's time (each takes 5-20 s here)
    out = sh(*spotguard, "drill", "-n", "1", "--launch-timeout", "100", "--", python, "train.py",
             "--steps", "80", "--step-sleep", "0.05", "--ckpt-dir", "drill-checkpoints", timeout=280)
    assert "spotguard drill: PASSED" in out, out
    logs = list(tmp_path.glob("spotguard-drill-*/*.log"))
    assert len(logs) >= 3, logs  # the reference's and two launches'
    for log in logs:
        no_warnings(log.read_text(), log.name)
    print(f"drill: {time.monotonic() - start:.1f} s")
