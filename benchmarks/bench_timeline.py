"""The notice timeline of a local drill: seconds from the daemon seeing a notice to each stage of its
handling, for a real ``spotguard.Run`` job stopped by ``spotguard notify`` through a real daemon.

Each round starts a job (a Linear model, one SGD step and ``--step-sleep`` per step, no periodic save)
on a fresh checkpoint directory, waits for its 5th step, sends a drill due in 60 s, waits for its
exit 75 and for the timeline's ``durable`` stage, and reads the stages from ``spotguard notices``'s
source (the daemon's ``status`` with ``history``). Baseline in the same run: the job's step period
(the stop is taken at the next step boundary, so flag -> stopped should stay within one step).

``--quick``: 3 rounds. Writes ``results/timeline.json``.

Exceptions: :class:`~_common.BenchError` when a round fails or the daemon does not answer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchError, DaemonProcess, markdown_table, summarize, write_results  # noqa: E402

from spotguard import _record  # noqa: E402
from spotguard.protocol import Kind, NotifyRequest, StatusRequest  # noqa: E402
from spotguard_daemon.commands.common import daemon_status, request  # noqa: E402

STAGES = ("published", "signalled", "flagged", "stopped", "committed", "safe", "durable")
JOB = """
import sys, time
import torch
from spotguard import Run
torch.set_num_threads(1)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
run = Run(sys.argv[1], model=model, optimizer=optimizer, save_every=1_000_000, job_id=sys.argv[2])
for step in run.steps(1_000_000):
    loss = model(torch.randn(16, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(float(sys.argv[3]))
"""


def wait_for(what, seconds: float, why: str):
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise BenchError(f"{why} within {seconds:g} s")


def one_round(daemon: DaemonProcess, work: Path, number: int, step_sleep: float) -> tuple[dict, list[float]]:
    """One drill: the timeline's seconds per stage, and the job's step periods (s)."""
    record = work / f"record-{number}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(SPOTGUARD_RUNTIME_DIR=str(daemon.runtime_dir), SPOTGUARD_RECORD=str(record))
    job = subprocess.Popen([sys.executable, "-c", JOB, str(work / f"job-{number}"), f"bench-{number}",
                            str(step_sleep)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 5 for e in _record.read(record)),
                 120, f"round {number}: the job made no 5 steps")
        reply = request(daemon.request_endpoint, NotifyRequest(kind=Kind.DRILL, deadline_seconds=60), 5)
        notice = reply.data["notice"]["id"]
        if job.wait(60) != 75:
            raise BenchError(f"round {number}: the job exited {job.returncode}: {job.stderr.read()[-2000:]}")
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()

    def done() -> dict | None:
        reply = request(daemon.request_endpoint, StatusRequest(history=8), 5)
        line = next((t for t in reply.data.get("history") or [] if t["id"] == notice), None)
        return line if line and "durable" in [s["stage"] for s in line["stages"]] else None

    line = wait_for(done, 60, f"round {number}: no durable stage")
    stages = {}
    for stage in line["stages"]:
        stages.setdefault(stage["stage"], stage["after_s"])
    progress = [e["t"] for e in _record.read(record) if e["event"] == "progress"]
    return stages | {"outcome": line["outcome"]}, [b - a for a, b in zip(progress, progress[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 3
    with tempfile.TemporaryDirectory(prefix="sgb-timeline-") as work:
        daemon = DaemonProcess(env={"SPOTGUARD_CHECKPOINT_ROOT": work})  # the jobs' roots lie below it
        try:
            wait_for(lambda: daemon_status(daemon.request_endpoint), 30, "the daemon did not answer")
            rounds = [one_round(daemon, Path(work), number, args.step_sleep) for number in range(args.rounds)]
        finally:
            daemon.stop()
    periods = [p * 1000 for _, steps in rounds for p in steps]
    results: dict[str, Any] = {stage: summarize([r[stage] * 1000 for r, _ in rounds if stage in r])
                               for stage in STAGES}
    results["step_period"] = summarize(periods)
    results["outcomes"] = [r["outcome"] for r, _ in rounds]
    rows = [(stage, results[stage].get("n"), results[stage].get("p50_ms"), results[stage].get("max_ms"))
            for stage in (*STAGES, "step_period")]
    print(markdown_table(["from seen to", "n", "p50 ms", "max ms"], rows))
    print(f"outcomes: {results['outcomes']}")
    print(f"results: {write_results('timeline', {'params': vars(args) | {'out': None}, 'results': results}, args.out)}")


if __name__ == "__main__":
    main()
