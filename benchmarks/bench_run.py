"""What ``spotguard run`` costs: the gap it adds between a launch's exit and the relaunch, and its
footprint while the job runs; against a shell loop that relaunches on 75 and asks nothing.

* **Relaunch gap.** A job (plain Python, no torch) appends its start time, then its exit time, to a
  log and exits 75, ``--relaunches`` times; then once more with 0. Under ``spotguard run`` a daemon
  answers, so after each exit the supervisor asks it for the pending notices, reads the run record
  and reports the job safe. Under the baseline, ``while :; do JOB; [ $? -eq 75 ] || break; done``.
  The gap is the next start minus the previous exit: Python's start-up is in both.
* **Footprint.** CPU (percent of one core, ``utime + stime`` over the window) and RSS of the
  supervisor while a job that traps SIGUSR1 sleeps, a daemon answering (the supervisor looks for
  new processes of the job every 0.5 s); the same for the shell loop.

``--quick``: 5 relaunches, a 3 s window. Writes ``results/run.json``.

Exceptions: :class:`~_common.BenchError` when a run fails or the daemon does not answer.
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
from bench_idle import sample  # noqa: E402

from spotguard_daemon.commands.common import daemon_status  # noqa: E402

JOB = """
import pathlib, sys, time
log, relaunches = pathlib.Path(sys.argv[1]), int(sys.argv[2])
with open(log, "a") as f:
    f.write(f"start {time.time()}\\n")
launch = log.read_text().count("start")
if launch > relaunches:
    sys.exit(0)
from spotguard._record import Recorder  # one step a launch: spotguard run stops a job that makes none
record = Recorder()
record.start(root=".", world_size=1, resumed_from=launch - 1, skipped=[], total=None)
record.emit("progress", step=launch)
with open(log, "a") as f:
    f.write(f"exit {time.time()}\\n")
sys.exit(75)
"""
SLEEPER = "import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: None); time.sleep(float(sys.argv[1]))"


def supervised(argv: list[str], env: dict[str, str]) -> list[str]:
    return [sys.executable, "-m", "spotguard_daemon", "run", "--", *argv]


def shell_loop(argv: list[str], env: dict[str, str]) -> list[str]:
    quoted = " ".join(f"'{a}'" for a in argv)
    return ["sh", "-c", f"while :; do {quoted}; s=$?; [ $s -eq 75 ] || exit $s; done"]


def gaps_ms(log: Path) -> list[float]:
    """Next start minus previous exit, per relaunch, in ms."""
    lines = [line.split() for line in log.read_text().splitlines()]
    exits = [float(t) for kind, t in lines if kind == "exit"]
    starts = [float(t) for kind, t in lines if kind == "start"][1:]
    return [1000 * (start - end) for end, start in zip(exits, starts)]


def relaunch_gaps(wrap, env: dict[str, str], work: Path, relaunches: int) -> dict[str, Any]:
    log = work / f"{wrap.__name__}.log"
    done = subprocess.run(wrap([sys.executable, "-c", JOB, str(log), str(relaunches)], env), env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise BenchError(f"{wrap.__name__} exited {done.returncode}: {done.stderr[-2000:]}")
    return summarize(gaps_ms(log))


def footprint(wrap, env: dict[str, str], window: float) -> dict[str, Any]:
    proc = subprocess.Popen(wrap([sys.executable, "-c", SLEEPER, str(window + 4)], env), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2.0)  # start-up, the daemon reached, the job registered
        return sample(proc.pid, window)
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--relaunches", type=int, default=50)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.relaunches, args.window = 5, 3.0
    daemon = DaemonProcess()
    try:
        give_up = time.monotonic() + 30
        while daemon_status(daemon.request_endpoint) is None:
            if time.monotonic() > give_up:
                raise BenchError(f"the daemon did not answer: {daemon.output()[-2000:]}")
            time.sleep(0.1)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env["SPOTGUARD_RUNTIME_DIR"] = str(daemon.runtime_dir)
        with tempfile.TemporaryDirectory() as work:
            results = {wrap.__name__: {"gap_ms": relaunch_gaps(wrap, env, Path(work), args.relaunches),
                                       "footprint": footprint(wrap, env, args.window)}
                       for wrap in (supervised, shell_loop)}
    finally:
        daemon.stop()
    rows = [(name, r["gap_ms"]["n"], r["gap_ms"]["p50_ms"], r["gap_ms"]["p99_ms"],
             r["footprint"]["cpu_pct"], r["footprint"]["rss_mb_max"]) for name, r in results.items()]
    print(markdown_table(["supervisor", "relaunches", "gap p50 ms", "gap p99 ms", "CPU % of a core",
                          "RSS MB"], rows))
    print(f"results: {write_results('run', {'params': vars(args) | {'out': None}, 'results': results}, args.out)}")


if __name__ == "__main__":
    main()
