"""A cadence that learns the preemption rate: a simulated fleet, the real daemon and a real Run.

For each true MTBF ``M`` (seconds of running time), one job lives through ``--lives`` lives: each is
a real process (forked from this one, which imported torch and spotguard first, so a life starts in
milliseconds) running ``spotguard.Run`` on the daemon's socket, with fast steps and saves that cost
about ``--cost`` seconds (a state entry that sleeps). Each life is SIGKILLed after a running time
drawn from an exponential distribution of mean ``M`` (a Poisson process of preemptions without
notice, as on vast.ai or RunPod; the same seeded draws for every policy), and the next life resumes
from the last commit. The daemon counts each restart and the running time between progress reports.

Three policies, same draws, same run:

* ``learned``: Run's cadence follows the MTBF the daemon learns (``cadence.node_mtbf_hours`` set to
  the guess ``G`` as the prior, weight 1);
* ``guess``: the baseline, a Cadence fixed at the guessed MTBF ``G`` (what a user sets today);
* ``oracle``: a Cadence fixed at the true ``M`` (Daly's optimum, unknowable in practice).

Per life the job logs each commit (step, when its step was reached, the save's blocking seconds,
the interval and MTBF planned); the harness knows when each life started its first step and when
it was killed. **Wasted time** = blocking save time of commits + rework (from the last commit's
step reached to the kill); running time = first step to kill. The **expected waste** of an interval
``T`` under Poisson failures of mean ``M`` with save cost ``C`` is ``1 - T / (M (exp((T+C)/M) - 1))``
(each segment of ``T`` work and one save is retried until it completes); the ratio of the final
learned interval's expected waste to the optimum's is the figure that settles "within 5 %": the
measured waste over a few dozen lives has a sampling error larger than that.

    python benchmarks/bench_cadence_learning.py [--quick] [--mtbf 1,2,4] [--lives 16] [--guess 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402  (imported before any fork: a life starts without paying for it)

from _common import BenchError, DaemonProcess, markdown_table, write_results  # noqa: E402
from spotguard import Run, cadence as cad  # noqa: E402
from spotguard.cadence import Cadence  # noqa: E402

NAME = "cadence_learning"
POLICIES = ("learned", "guess", "oracle")
STEP_S = 0.002
PROGRESS_S = 0.02
FLOOR_S = 0.1


class SlowEntry:
    """A checkpoint entry whose state_dict sleeps: every save blocks the loop about ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def state_dict(self) -> dict:
        time.sleep(self.seconds)
        return {"seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.seconds = state["seconds"]


def life(root: Path, cadence: Cadence, cost: float, mark: Path, log: Path, held: Path) -> None:
    """The child: train until killed. ``mark`` holds (first step's time, step resumed from);
    ``log`` gets one JSON line per commit, ``held`` one per change of the MTBF the cadence plans
    with (a life killed before its first commit still shows what the daemon had taught it)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    reached: dict[int, float] = {}
    out = open(log, "a", buffering=1)

    def committed(info: Any) -> None:
        stats = run.checkpointer.stats
        out.write(json.dumps({"step": info.step, "reached": reached.get(info.step), "blocking_s":
                              stats.blocking_seconds, "interval_s": run.cadence.interval_s,
                              "mtbf_s": run.cadence.mtbf_s, "cost_s": run.cadence.cost_s,
                              "source": run.cadence.mtbf_source}) + "\n")

    run = Run(root, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
              state={"slow": SlowEntry(cost)}, cadence=cadence, job_id="cadence-bench", keep=2,
              on_commit=committed)
    first, plan = True, None
    plans = open(held, "a", buffering=1)
    for step in run.steps(10**9):
        if (run.cadence.mtbf_s, run.cadence.mtbf_source) != plan:
            plan = (run.cadence.mtbf_s, run.cadence.mtbf_source)
            plans.write(json.dumps({"mtbf_s": plan[0], "source": plan[1], "step": step}) + "\n")
        now = time.monotonic()
        reached[step] = now
        if len(reached) > 100_000:
            reached.pop(next(iter(reached)))
        if first:
            mark.write_bytes(struct.pack("dq", now, step))
            first = False
        time.sleep(STEP_S)


def run_policy(policy: str, mtbf: float, draws: list[float], args: argparse.Namespace,
               work: Path) -> dict[str, Any]:
    """One job through ``len(draws)`` lives under ``policy``; its figures."""
    root, logs = work / f"{policy}-{mtbf:g}", work / f"{policy}-{mtbf:g}-logs"
    root.mkdir()
    logs.mkdir()
    t0 = time.monotonic()
    daemon = DaemonProcess(env={"SPOTGUARD_CADENCE__NODE_MTBF_HOURS": str(args.guess / 3600),
                                "SPOTGUARD_CADENCE__MIN_MTBF_SECONDS": str(FLOOR_S),
                                "SPOTGUARD_STORAGE__URL": "none", "SPOTGUARD_CHECKPOINT_ROOT": str(root)})
    lives = []
    try:
        _wait_for_socket(daemon)
        print(f"daemon up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        for i, draw in enumerate(draws):
            mark, log, held = logs / f"mark-{i}", logs / f"log-{i}.jsonl", logs / f"held-{i}.jsonl"
            fixed = {"learned": None, "guess": args.guess, "oracle": mtbf}[policy]
            cadence = Cadence(mtbf_s=args.guess if fixed is None else fixed, learn=fixed is None,
                              cost_s=args.cost)  # every policy knows the save cost: the MTBF is studied
            forked = time.monotonic()
            pid = os.fork()
            if pid == 0:  # the life: never returns
                code = 1
                try:
                    os.environ.update(SPOTGUARD_RUNTIME_DIR=str(daemon.runtime_dir),
                                      SPOTGUARD_PROGRESS_SECONDS=str(PROGRESS_S))
                    life(root, cadence, args.cost, mark, log, held)
                    code = 0
                finally:
                    os._exit(code)
            began = _wait_for_mark(mark, pid, daemon)
            time.sleep(max(0.0, began + draw - time.monotonic()))
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            os.waitpid(pid, 0)
            lives.append({**_life_figures(mark, log, began, killed), "start_s": round(began - forked, 3),
                          "held": _last_line(held)})
    finally:
        daemon.stop()
    return _policy_figures(policy, mtbf, lives, args)


def _wait_for_socket(daemon: DaemonProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (daemon.runtime_dir / "requests.sock").exists():
        if daemon.proc.poll() is not None or time.monotonic() > deadline:
            raise BenchError(f"the daemon did not start: {daemon.output()[-2000:]}")
        time.sleep(0.05)


def _wait_for_mark(mark: Path, pid: int, daemon: DaemonProcess, timeout: float = 60.0) -> float:
    """When the life began its first step (its mark); BenchError if it died or took too long."""
    deadline = time.monotonic() + timeout
    while not (mark.exists() and mark.stat().st_size == 16):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            if not done:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise BenchError(f"a life ended (status {status}) before its first step: {daemon.output()[-2000:]}")
        time.sleep(0.001)
    return struct.unpack("dq", mark.read_bytes())[0]


def _last_line(path: Path) -> dict[str, Any] | None:
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1]) if lines else None


def _life_figures(mark: Path, log: Path, began: float, killed: float) -> dict[str, Any]:
    _, start = struct.unpack("dq", mark.read_bytes())
    commits = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    last = commits[-1] if commits else None
    safe_at = last["reached"] if last and last["reached"] is not None else began
    return {"running_s": killed - began, "start_step": start, "commits": len(commits),
            "blocking_s": sum(c["blocking_s"] or 0.0 for c in commits),
            "rework_s": max(0.0, killed - safe_at),
            "plan": None if last is None else {k: last[k] for k in ("interval_s", "mtbf_s", "cost_s", "source")}}


def expected_waste(interval: float, mtbf: float, cost: float) -> float:
    """Fraction of running time lost with saves every ``interval`` s of work costing ``cost`` s,
    under Poisson failures of mean ``mtbf`` (no restart cost): ``1 - T/(M(exp((T+C)/M) - 1))``."""
    return 1.0 - interval / (mtbf * math.expm1((interval + cost) / mtbf))


def _policy_figures(policy: str, mtbf: float, lives: list[dict[str, Any]],
                    args: argparse.Namespace) -> dict[str, Any]:
    running = sum(x["running_s"] for x in lives)
    wasted = sum(x["blocking_s"] + x["rework_s"] for x in lives)
    plans = [x["plan"] for x in lives if x["plan"] is not None]
    final = plans[-1] if plans else None
    cost = final["cost_s"] if final else args.cost
    best = cad.daly_interval(mtbf, cost)
    out = {"policy": policy, "mtbf_s": mtbf, "lives": len(lives), "running_s": round(running, 3),
           "wasted_s": round(wasted, 3), "waste": round(wasted / running, 4) if running else None,
           "progress_steps": lives[-1]["start_step"] if lives else 0, "daly_optimum_s": round(best, 4),
           "life_start_s": [x["start_s"] for x in lives],
           "expected_waste_optimum": round(expected_waste(best, mtbf, cost), 4),
           "trajectory": [None if p is None else {k: round(v, 4) if isinstance(v, float) else v
                                                  for k, v in p.items()} for p in (x["plan"] for x in lives)],
           "held": [x["held"] for x in lives]}
    if final:
        out.update(final_interval_s=round(final["interval_s"], 4), final_mtbf_s=round(final["mtbf_s"], 3),
                   cost_s=round(cost, 4),
                   expected_waste_final=round(expected_waste(final["interval_s"], mtbf, cost), 4))
        out["expected_vs_optimum"] = round(out["expected_waste_final"] / out["expected_waste_optimum"], 4)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="one rate, 3 lives (a smoke test)")
    parser.add_argument("--mtbf", default="1,2,4", help="true MTBFs, seconds of running, comma-separated")
    parser.add_argument("--lives", type=int, default=16)
    parser.add_argument("--guess", type=float, default=8.0, help="the guessed MTBF (baseline and prior)")
    parser.add_argument("--cost", type=float, default=0.05, help="seconds each save blocks the loop")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rates = [1.0] if args.quick else [float(x) for x in args.mtbf.split(",")]
    lives = 3 if args.quick else args.lives
    torch.set_num_threads(1)
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)  # imports torch._dynamo (3 s) before the forks
    results = []
    with tempfile.TemporaryDirectory(prefix="sg-cadence-") as tmp:
        for mtbf in rates:
            rng = random.Random(f"{args.seed}-{mtbf}")
            draws = [rng.expovariate(1 / mtbf) for _ in range(lives)]
            for policy in POLICIES:
                results.append(run_policy(policy, mtbf, draws, args, Path(tmp)))
                print(f"M={mtbf:g} s {policy}: waste {results[-1]['waste']}", file=sys.stderr)
    rows = [(f"{r['mtbf_s']:g}", r["policy"], r["lives"], r.get("final_mtbf_s", "-"), r.get("final_interval_s", "-"),
             r["daly_optimum_s"], f"{100 * r['waste']:.1f}" if r["waste"] is not None else "-",
             f"{100 * r.get('expected_waste_final', math.nan):.1f}", f"{100 * r['expected_waste_optimum']:.1f}",
             r.get("expected_vs_optimum", "-")) for r in results]
    print(markdown_table(["true MTBF s", "policy", "lives", "final MTBF s", "final interval s", "Daly optimum s",
                          "waste measured %", "waste expected %", "optimum expected %", "expected / optimum"], rows))
    path = write_results(NAME, {"params": {"rates_s": rates, "lives": lives, "guess_s": args.guess,
                                           "cost_s": args.cost, "step_s": STEP_S, "progress_s": PROGRESS_S,
                                           "floor_s": FLOOR_S, "seed": args.seed},
                                "results": results}, args.out)
    print(f"results: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
