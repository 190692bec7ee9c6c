"""A notice during an evaluation: committed how long after it, against its deadline; steps lost.

A real CPU training job (a synthetic MLP, AdamW: ~100 MB of state, ``save_every=25``) trains 40
steps, then evaluates inside its loop body (dropout on, ``torch.rand`` inputs, ``run.heartbeat()``
per batch) for ``--eval-seconds`` (60 s; ``--quick``: 20 s). SIGTERM (30 s deadline: Kubernetes'
default grace, GCP's notice) arrives 2 s into the evaluation. Two modes, in the same run:

* ``between`` (this release): ``Run(optimizer=...)``: the step's state is saved beside the
  evaluation, which stops at its next ``run.heartbeat()``;
* ``boundary`` (the behaviour before): the same job without ``optimizer=`` (the optimizer handed in
  ``state=``), so ``Run`` cannot tell a step ended and acts at the next step boundary, after the
  evaluation, or is ended by the forced exit (76) at the deadline minus 2 s;
* ``hf``: the same model in a Hugging Face ``Trainer`` (``save_steps=25``, an evaluation after step
  40 whose prediction steps take as long), with :class:`SpotguardTrainerCallback`: the Trainer
  writes ``checkpoint-40`` at the next prediction step after the notice, and ``train()`` ends with 75;
* ``2ranks``: the ``between`` job as DDP under ``torchrun --nproc-per-node 2`` (gloo), with
  ``Run(agree_at_heartbeat=True)``; the SIGTERM goes to rank 1 alone, and the ranks agree at a
  heartbeat to save step 40 and stop;
* ``2ranks-boundary`` (the behaviour before, and without ``agree_at_heartbeat``): the same, acting
  at the next boundary, after the evaluation.

Per mode: the exit status, the notice to the last commit (``on_commit``'s print, Unix times on one
machine), the deadline, the step committed and the steps lost (trained but not committed: 40 minus
the committed step). Results go to ``results/eval_notice.json`` and a table to stdout.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, write_results  # noqa: E402

DEADLINE = 30.0
STEPS_BEFORE_EVAL = 40
MODES = ("between", "boundary", "hf", "2ranks", "2ranks-boundary")

JOB = textwrap.dedent('''
    import os, sys, time
    import torch
    from torch import nn
    import spotguard

    root, mode, eval_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    ranks = mode.startswith("2ranks")
    if ranks:
        torch.distributed.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Dropout(0.1), nn.Linear(4096, 2048))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if ranks:
        model = nn.parallel.DistributedDataParallel(model)
    commit = lambda info: rank == 0 and print(f"commit {info.step} {time.time():.3f}", flush=True)
    if mode == "between" or ranks:
        run = spotguard.Run(root, model=model, optimizer=opt, save_every=25, daemon=False, on_commit=commit,
                            agree_at_heartbeat=mode == "2ranks")
    else:
        run = spotguard.Run(root, model=model, state={"optimizer": opt}, save_every=25, daemon=False,
                            on_commit=commit)
    with run:
        for step in run.steps(1000):
            x = torch.randn(16, 1024)
            loss = model(x).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            if step + 1 == %d:
                if rank == int(ranks):  # rank 1 of 2: the notice reaches it alone
                    print(f"eval {step} {time.time():.3f} {os.getpid()}", flush=True)
                started, n = time.monotonic(), 0
                with torch.no_grad():  # ranks: the same batches everywhere, so the same heartbeats
                    while (n < eval_s / 0.05) if ranks else (time.monotonic() - started < eval_s):
                        model(torch.rand(16, 1024)); time.sleep(0.05); n += 1
                        run.heartbeat()
                print("evaluated", flush=True)
''' % STEPS_BEFORE_EVAL)

HF_JOB = textwrap.dedent('''
    import sys, time
    import torch, transformers
    from torch import nn
    from spotguard.integrations.huggingface import SpotguardTrainerCallback

    root, eval_s = sys.argv[1], float(sys.argv[3])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Dropout(0.1), nn.Linear(4096, 2048))

        def forward(self, x):
            if not self.training:
                time.sleep(0.05)
            return {"loss": self.net(x).pow(2).mean()}

    class Data(torch.utils.data.Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return {"x": torch.randn(1024)}

    class Print(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if control.should_evaluate:
                print(f"eval {state.global_step} {time.time():.3f}", flush=True)

        def on_save(self, args, state, control, **kwargs):
            print(f"commit {state.global_step} {time.time():.3f}", flush=True)

    transformers.set_seed(0)
    args = transformers.TrainingArguments(
        root, max_steps=1000, per_device_train_batch_size=16, per_device_eval_batch_size=16, save_steps=25,
        eval_strategy="steps", eval_steps=%d, prediction_loss_only=True, use_cpu=True, report_to=[],
        logging_strategy="no", disable_tqdm=True, learning_rate=1e-4)
    guard = SpotguardTrainerCallback(daemon=False)
    trainer = transformers.Trainer(Model(), args, train_dataset=Data(16000),
                                   eval_dataset=Data(int(eval_s / 0.05) * 16), callbacks=[guard, Print()])
    trainer.train()
    guard.exit_if_stopped()
''' % STEPS_BEFORE_EVAL)


def one(mode: str, eval_s: float, work: Path) -> dict:
    script = work / f"{mode}.py"
    script.write_text(HF_JOB if mode == "hf" else JOB)
    root = work / mode
    env = {"SPOTGUARD_SIGNAL__GRACE": str(DEADLINE), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "SPOTGUARD_RUNTIME_DIR": str(work / "rt"), "PATH": "/usr/bin:/bin"}
    launcher = ["-m", "torch.distributed.run", "--standalone", "--max-restarts", "0", "--nproc-per-node", "2"]
    proc = subprocess.Popen([sys.executable, *(launcher if mode.startswith("2ranks") else []), str(script),
                             str(root), mode, str(eval_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    commits: list[tuple[int, float]] = []
    sent = None
    try:
        for line in proc.stdout:
            parts = line.split()
            if parts[:1] == ["commit"]:
                commits.append((int(parts[1]), float(parts[2])))
            elif parts[:1] == ["eval"] and sent is None:
                time.sleep(2.0)  # the notice lands 2 s into the evaluation (of rank 1 alone, with 2)
                sent = time.time()
                os.kill(int(parts[3]) if len(parts) > 3 else proc.pid, signal.SIGTERM)
        proc.wait(timeout=eval_s + 120)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    gone = time.time()
    after = [(s, t) for s, t in commits if sent is not None and t >= sent]
    step = max((s for s, _ in commits), default=0)
    workers = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", err))  # torchrun's
    return {"mode": mode, "eval_s": eval_s, "deadline_s": DEADLINE,  # summary of its failed workers
            "status": ", ".join(workers[r] for r in sorted(workers)) if workers else proc.returncode,
            "notice_to_commit_s": round(after[-1][1] - sent, 2) if after else None,
            "notice_to_exit_s": round(gone - sent, 2) if sent else None,
            "committed_step": step, "steps_lost": STEPS_BEFORE_EVAL - step,
            "stderr_tail": err.strip().splitlines()[-3:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 20 s evaluation instead of 60 s")
    p.add_argument("--eval-seconds", type=float, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--modes", default=",".join(MODES), help=f"a comma-separated subset of {','.join(MODES)}")
    a = p.parse_args()
    eval_s = a.eval_seconds or (20.0 if a.quick else 60.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-eval-notice-") as tmp:
        for mode in a.modes.split(","):
            rows.append(one(mode, eval_s, Path(tmp)))
    write_results("eval_notice", {"eval_seconds": eval_s, "steps_before_eval": STEPS_BEFORE_EVAL,
                                  "rows": rows}, a.out)
    print(markdown_table(
        ["mode", "evaluation s", "deadline s", "status", "notice -> commit s", "notice -> exit s",
         "step committed", "steps lost"],
        [[r["mode"], r["eval_s"], r["deadline_s"], r["status"], r["notice_to_commit_s"] or "none",
          r["notice_to_exit_s"], r["committed_step"], r["steps_lost"]] for r in rows]))


if __name__ == "__main__":
    main()
