"""A job for the learned-cadence test: a Run on its default (Young/Daly) cadence, fast steps.

    python cadence_job.py ROOT --ready FILE --expect N [--finish] [--save-cost S]

It trains until the daemon's estimate counts ``N`` interruptions of the job (the progress reply's
``JobRate``), its cadence follows it and a periodic save of this life committed, then writes FILE
with what its cadence plans with. Then
it trains on until a notice stops it (exit 75), or with ``--finish`` leaves the loop (exit 0).
``--save-cost`` makes each save block that long (a state entry that sleeps); the cadence assumes
that cost until it measured one, so that the first periodic save comes within seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from spotguard import Cadence, Run

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_cadence_learning import SlowEntry  # noqa: E402  (the benchmark's save of a set cost)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--ready", type=Path, required=True)
    parser.add_argument("--expect", type=int, required=True)
    parser.add_argument("--finish", action="store_true")
    parser.add_argument("--save-cost", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Linear(2, 1)
    commits: list[int] = []
    run = Run(args.root, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
              state={"slow": SlowEntry(args.save_cost)}, job_id="cadence-e2e",
              cadence=Cadence(cost_s=args.save_cost), on_commit=lambda info: commits.append(info.step))
    ready = False
    for step in run.steps(10**9):
        time.sleep(0.01)
        rate = run.guard.job_rate
        if not ready and rate is not None and rate.interruptions >= args.expect and commits \
                and run.cadence.mtbf_s == rate.mtbf_s:
            ready = True
            report = {"rate": rate.model_dump(), "mtbf_s": run.cadence.mtbf_s,
                      "source": run.cadence.mtbf_source, "interval_s": run.cadence.interval_s,
                      "cost_s": run.cadence.cost_s, "floor_s": run.cadence.floor_s, "pid": os.getpid()}
            tmp = args.ready.with_suffix(".tmp")
            tmp.write_text(json.dumps(report))
            tmp.replace(args.ready)
            if args.finish:
                break
    run.finish()


if __name__ == "__main__":
    main()
