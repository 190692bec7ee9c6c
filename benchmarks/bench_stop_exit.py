"""Stop to exit: how long a rank takes to be gone after its clean stop is committed.

A SIGTERM (the notice: Kubernetes, RunPod, ``docker stop``) goes to every rank of a real training
job; each rank saves, commits, tells the daemon "safe" (none runs here: the requests time out at
once), writes the run record's ``stop`` line and exits 75. Measured per rank, from the run record
(``$SPOTGUARD_RECORD``: Unix times on this machine) and ``waitpid``:

* ``notice_to_commit``: the signal to the emergency save's ``commit`` line (rank 0);
* ``commit_to_gone``: that ``stop`` line to the process being reaped (the slowest rank).

Jobs: ``plain`` (examples/train_plain.py, no loader workers), ``loader2`` (examples/train_loader.py
with a 2-worker spotguard.DataLoader), ``gloo2`` (train_plain.py as 2 gloo ranks, launched directly
with ``RANK``/``WORLD_SIZE``/``MASTER_*``). Each job runs with the prompt exit (``fast``) and with
``$SPOTGUARD_FAST_EXIT=0`` (``baseline``: the interpreter's full teardown), alternately, in the same
run. ``orphans`` counts loader workers still alive after their parent was reaped (must be 0).
``--quick`` runs each pair once (a smoke test); the full run ``--repeat`` times (default 5).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchError, markdown_table, summarize, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOBS = {
    "plain": (1, ["examples/train_plain.py"]),
    "loader2": (1, ["examples/train_loader.py", "--workers", "2"]),
    "gloo2": (2, ["examples/train_plain.py"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(record: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _children(pid: int) -> set[int]:
    try:
        return {int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def one_stop(job: str, fast: bool, work: Path) -> dict[str, Any]:
    """Start ``job``, SIGTERM every rank once all train, and time the stop and the exits."""
    ranks, argv = JOBS[job]
    record = work / "record.jsonl"
    env = dict(os.environ, SPOTGUARD_RECORD=str(record), SPOTGUARD_FAST_EXIT="1" if fast else "0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks),
               SPOTGUARD_JOB_ID=f"bench-{job}", SPOTGUARD_RUNTIME_DIR=str(work / "rt"))
    procs = [subprocess.Popen([sys.executable, *argv, "--steps", "1000000", "--ckpt-dir", str(work / "ckpt"),
                               "--step-sleep", "0.01"], cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(ranks)]
    try:
        deadline = time.monotonic() + 120
        while sum(e["event"] == "start" for e in _events(record)) < ranks or \
                not any(e["event"] == "progress" and e["step"] >= 5 for e in _events(record)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise BenchError(f"{job}: the job did not start training")
            time.sleep(0.05)
        workers = set().union(*(_children(p.pid) for p in procs))
        notice = time.time()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        gone = {}
        for p in procs:
            p.wait(120)
            gone[p.pid] = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    events = _events(record)
    stops = {e["pid"]: e["t"] for e in events if e["event"] == "stop"}
    commit = next((e["t"] for e in events if e["event"] == "commit" and e["kind"] == "emergency"), None)
    if len(stops) != ranks or commit is None:
        raise BenchError(f"{job}: stop lines {len(stops)}/{ranks}, emergency commit {commit}")
    return {"codes": [p.returncode for p in procs], "notice_to_commit_ms": (commit - notice) * 1e3,
            "commit_to_gone_ms": max(gone[pid] - t for pid, t in stops.items()) * 1e3,
            "orphans": sum(_alive(w) for w in workers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    samples: dict[str, list[dict[str, Any]]] = {}
    for _ in range(repeat):
        for job in args.jobs.split(","):
            for mode in ("baseline", "fast"):
                with tempfile.TemporaryDirectory(prefix="bench-stop-") as work:
                    samples.setdefault(f"{job}/{mode}", []).append(one_stop(job, mode == "fast", Path(work)))
    results = {key: {"codes": sorted({c for s in runs for c in s["codes"]}),
                     "orphans": sum(s["orphans"] for s in runs),
                     "notice_to_commit": summarize([s["notice_to_commit_ms"] for s in runs]),
                     "commit_to_gone": summarize([s["commit_to_gone_ms"] for s in runs])}
               for key, runs in samples.items()}
    path = write_results("stop_exit", {"repeat": repeat, "results": results}, args.out)
    print(markdown_table(
        ["job/mode", "n", "notice→commit p50 ms", "commit→gone p50 ms", "commit→gone max ms", "codes", "orphans"],
        [(key, r["commit_to_gone"]["n"], r["notice_to_commit"]["p50_ms"], r["commit_to_gone"]["p50_ms"],
          r["commit_to_gone"]["max_ms"], r["codes"], r["orphans"]) for key, r in results.items()]))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
