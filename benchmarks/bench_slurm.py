"""Slurm preemption: from the preempting job's submission to the committed checkpoint and the node freed.

A real one-node cluster (tests/slurm/slurm_cluster.py: munged, slurmctld and slurmd from Debian's
packages; needs root) with two partitions: ``low`` (``GraceTime``, default 20 s) and ``high``, with
``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE`` and
``SlurmctldParameters=preempt_send_user_signal``. One repeat: deploy/slurm/train.sbatch runs
examples/train_loader.py (two loader workers) in ``low`` until its first periodic checkpoint; then a
job is submitted to ``high`` (t = 0) and the low job's run record and state are followed:

* ``stop``: training decided to stop (the record's ``stop`` event);
* ``commit``: its emergency checkpoint committed (the record's ``commit`` event);
* ``off_node``: Slurm no longer shows the job running or completing (``squeue`` polled every 50 ms),
  so the high-priority job can start. This includes the Python process's exit, whose interpreter
  teardown with torch loaded takes seconds on a loaded machine, and the script's daemon stop.

Variants, in the same run: ``signal`` is the script as shipped (``--signal=B:USR1@120``: Slurm sends
USR1 at the preemption); the baseline ``no-signal`` has that line removed, so the job hears only the
SIGTERM that Slurm sends when the GraceTime is over (then SIGKILL ``KillWait``, 5 s, later).

``--quick``: one repeat of each variant; the full run three. Writes ``results/slurm.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "slurm"))
from _common import markdown_table, summarize, write_results  # noqa: E402
from slurm_cluster import Cluster, missing, wait_for  # noqa: E402
from slurm_job import Job  # noqa: E402

TRAIN = ("--steps", "5000", "--workers", "2", "--save-every", "25", "--step-sleep", "0.02")
SIGNAL_LINE = "#SBATCH --signal=B:USR1@120\n"
POLL_S = 0.05


def one_preemption(cluster: Cluster, workdir: Path, variant: str) -> dict[str, Any]:
    """Preempt one job; seconds from the high job's submission to each milestone."""
    job = Job(cluster, workdir)
    if variant == "no-signal":
        script = workdir / "train.sbatch"
        script.write_text(script.read_text().replace(SIGNAL_LINE, ""))
    job.submit("--partition", "low", "--cpus-per-task", "2", args=TRAIN)
    job.wait_event("commit", timeout=120)
    t0 = time.time()
    cluster.sbatch("--partition", "high", "--cpus-per-task", "2", "--wrap", "sleep 1", cwd=workdir)
    off_node = wait_for("the job off the node", lambda: cluster.busy(job.id) is False and time.time(),
                        cluster.grace_time + 60, POLL_S)
    stops, commits = job.events("stop"), [c for c in job.events("commit") if c["kind"] == "emergency"]
    result = {"variant": variant, "stop_s": stops[0]["t"] - t0 if stops else None,
              "commit_s": commits[-1]["t"] - t0 if commits else None, "off_node_s": off_node - t0,
              "saved": bool(stops and stops[0]["saved"]), "notice": stops[0]["notice"]["kind"] if stops else None,
              "state": job.state()}
    cluster.cancel_all()
    return result


def run(repeats: int, grace: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="sg-bench-slurm-"))
    samples: list[dict[str, Any]] = []
    cluster = Cluster(grace_time=grace, kill_wait=5)
    try:
        with cluster:
            for r in range(repeats):
                for variant in ("signal", "no-signal"):
                    sample = one_preemption(cluster, base / f"{variant}-{r}", variant)
                    shown = (f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in sample.items())
                    print(f"  {variant} #{r}: " + ", ".join(shown), flush=True)
                    samples.append(sample)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(cluster.base, ignore_errors=True)
    return {"grace_time_s": grace, "repeats": repeats, "samples": samples, "summary": summary(samples)}


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in ("signal", "no-signal"):
        mine = [s for s in samples if s["variant"] == variant]
        out[variant] = {key: summarize([s[key] * 1000 for s in mine if s[key] is not None])
                        for key in ("stop_s", "commit_s", "off_node_s")}
        out[variant]["saved"] = sum(s["saved"] for s in mine)
        out[variant]["n"] = len(mine)
    return out


def table(result: dict[str, Any]) -> str:
    def cell(stats: dict[str, Any]) -> str:
        return "-" if not stats.get("n") else f"{stats['p50_ms'] / 1000:.1f} s (max {stats['max_ms'] / 1000:.1f})"
    rows = [(variant, f"{s['saved']}/{s['n']}", cell(s["stop_s"]), cell(s["commit_s"]), cell(s["off_node_s"]),
             f"{result['grace_time_s']} s") for variant, s in result["summary"].items()]
    return markdown_table(("variant", "saved", "stop decided", "checkpoint committed", "job off the node",
                           "GraceTime"), rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of each variant")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grace", type=int, default=20, help="the low partition's GraceTime, seconds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    why = missing()
    if why:
        print(f"bench_slurm: cannot run a Slurm cluster here: {why}", file=sys.stderr)
        return 2
    result = run(1 if args.quick else args.repeats, args.grace)
    print(table(result))
    print(f"wrote {write_results('slurm', result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
