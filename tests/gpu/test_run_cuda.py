"""``spotguard.Run`` on a GPU, end to end: a job written from the README (CUDA model, bf16 autocast,
dropout, AdamW, a cosine schedule, batches drawn from torch's CUDA generator) is stopped by SIGTERM
mid-run, saves its CUDA state on the emergency path, exits 75, and the relaunch ends bit-identical
to an uninterrupted run.

Skipped where no GPU is present (CI has none); run on a GPU machine with
``python -m pytest tests/gpu`` (``scripts/gpu-checks.sh``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

JOB = textwrap.dedent("""
    import hashlib, sys, time
    import torch
    from torch import nn
    import spotguard

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 1)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=40)
    run = spotguard.Run(sys.argv[1], model=model, optimizer=optimizer, scheduler=scheduler,
                        save_every=15, daemon=False)
    with run:
        for step in run.steps(40):
            x = torch.randn(64, 256, device="cuda")  # the CUDA generator: its state is saved too
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            print(f"step {step}", flush=True)
            time.sleep(float(sys.argv[2]))
    sha = hashlib.sha256()
    for t in [*model.state_dict().values(), *(v for s in optimizer.state.values() for v in s.values())]:
        sha.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    print("DIGEST", sha.hexdigest(), flush=True)
""")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    return {**env, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}


def _digest(out: str) -> str:
    (found,) = re.findall(r"^DIGEST ([0-9a-f]{64})$", out, re.M)
    return found


@pytest.mark.timeout(300)
def test_a_cuda_job_stopped_by_sigterm_resumes_bit_identical(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    reference = subprocess.run([sys.executable, str(script), str(tmp_path / "ref"), "0"], env=_env(),
                               capture_output=True, text=True, timeout=240)
    assert reference.returncode == 0, reference.stderr[-3000:]
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt"), "0.05"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.strip() == "step 20":  # past the periodic save at 15: the emergency save adds steps
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 75, out[-3000:]
    stopped = max(int(n) for n in re.findall(r"^step (\d+)$", out, re.M))
    assert stopped >= 20
    resumed = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), "0"], env=_env(),
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = min(int(n) for n in re.findall(r"^step (\d+)$", resumed.stdout, re.M))
    assert first == stopped + 1, (stopped, first)  # the emergency save held the last step done
    assert _digest(resumed.stdout) == _digest(reference.stdout)
