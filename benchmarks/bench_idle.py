"""Idle footprint: the daemon's RSS and CPU with one platform watcher at 1 s and no notices.

One AWS simulator process and one daemon (``--platform aws``, default settings: 1 s interval,
heartbeats every 1 s, metrics on a free loopback port) run with no interruption scheduled. After a
warm-up, the benchmark samples the daemon's ``/proc/<pid>/status`` VmRSS once a second and takes
CPU as the ``utime + stime`` delta of ``/proc/<pid>/stat`` over the window divided by its wall time
(percent of one core). The simulator's request counter gives the polls actually made. Two
diagnostic daemons run beside it, each measured alone: ``aws_spot_only`` (the scheduled-events and
rebalance watchers off, so one IMDS path instead of three) and ``no_watcher`` (``--platform none``:
heartbeats, metrics, housekeeping only), which split the CPU between polling and the rest.

Targets (issue 2): RSS <= 60 MB and CPU <= 0.5 % of one core, over >= 60 s. ``--quick``: 5 s.

Exceptions: :class:`~_common.BenchError` when the daemon exits or never polls.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchError, DaemonProcess, SimProcess, markdown_table, write_results  # noqa: E402

RSS_TARGET_MB = 60.0
CPU_TARGET_PCT = 0.5
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (fields 14 and 15 of /proc/<pid>/stat, after the comm)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise BenchError(f"no VmRSS for pid {pid}")


def sample(pid: int, seconds: float) -> dict[str, Any]:
    """CPU percent of one core and RSS (min, mean, max in MB) of ``pid`` over ``seconds``."""
    cpu0, wall0, rss = cpu_seconds(pid), time.monotonic(), []
    while time.monotonic() - wall0 < seconds:
        rss.append(rss_mb(pid))
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - wall0))))
    wall = time.monotonic() - wall0
    cpu = cpu_seconds(pid) - cpu0
    return {"window_s": round(wall, 2), "cpu_s": round(cpu, 3), "cpu_pct": round(100 * cpu / wall, 3),
            "rss_mb_min": round(min(rss), 2), "rss_mb_mean": round(sum(rss) / len(rss), 2),
            "rss_mb_max": round(max(rss), 2), "rss_samples": len(rss)}


VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "aws": ("aws", {}),
    "aws_spot_only": ("aws", {"SPOTGUARD_AWS__SCHEDULED_EVENTS": "false", "SPOTGUARD_AWS__REBALANCE": "false"}),
    "no_watcher": ("none", {}),
}
"""The measured configuration (``aws``: defaults) and two diagnostics that show where its CPU goes."""


def run_variant(platform: str, env: dict[str, str], seconds: float, warmup: float) -> dict[str, Any]:
    """Footprint of one daemon (and its own simulator) over ``seconds`` after ``warmup``."""
    sim = SimProcess("aws")
    daemon = DaemonProcess(platform, sim.url if platform == "aws" else None, env=env)
    try:
        started = time.monotonic()  # the warm-up counts from the daemon's first poll: its start-up
        while (platform == "aws" and sim.control("state")["requests"]["total"] == 0  # can take
               and daemon.proc.poll() is None and time.monotonic() - started < 60):  # seconds under load
            time.sleep(0.1)
        time.sleep(warmup)
        if daemon.proc.poll() is not None:
            raise BenchError(f"the daemon exited: {daemon.output()[-2000:]}")
        before = sim.control("state")["requests"]["total"]
        result = sample(daemon.proc.pid, seconds)
        result["metadata_requests"] = sim.control("state")["requests"]["total"] - before
        if platform == "aws" and result["metadata_requests"] == 0:
            raise BenchError("the daemon made no metadata requests")
        return result
    finally:
        daemon.stop()
        sim.stop()


def run(seconds: float, warmup: float, variants: list[str]) -> dict[str, Any]:
    """Every variant at once, one thread each (each daemon is its own process, measured alone)."""
    results: dict[str, Any] = {}

    def one(name: str) -> None:
        platform, env = VARIANTS[name]
        results[name] = run_variant(platform, env, seconds, warmup)

    threads = [threading.Thread(target=one, args=(name,)) for name in variants]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if set(results) != set(variants):
        raise BenchError(f"variants failed: {sorted(set(variants) - set(results))}")
    return {name: results[name] for name in variants}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="5 s window, 3 s warm-up (smoke test)")
    parser.add_argument("--seconds", type=float, default=None, help="measured window (default 120)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before measuring (default 10)")
    parser.add_argument("--only-aws", action="store_true", help="skip the diagnostic variants")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    seconds = args.seconds or (5.0 if args.quick else 120.0)
    warmup = args.warmup or (3.0 if args.quick else 10.0)
    results = run(seconds, warmup, ["aws"] if args.only_aws else list(VARIANTS))
    main_result = results["aws"]
    main_result |= {"rss_target_mb": RSS_TARGET_MB, "cpu_target_pct": CPU_TARGET_PCT,
                    "meets_target": main_result["rss_mb_max"] <= RSS_TARGET_MB
                    and main_result["cpu_pct"] <= CPU_TARGET_PCT}
    params = {"platform": "aws", "interval_s": 1.0, "seconds": seconds, "warmup_s": warmup, "quick": args.quick,
              "variants": {name: {"platform": VARIANTS[name][0], "env": VARIANTS[name][1]} for name in results}}
    path = write_results("idle", {"params": params, "results": results}, args.out)
    print(markdown_table(["daemon", "window s", "metadata requests", "CPU % of one core", "RSS MB (mean / max)"],
                         [[name, r["window_s"], r["metadata_requests"], r["cpu_pct"],
                           f"{r['rss_mb_mean']} / {r['rss_mb_max']}"] for name, r in results.items()]))
    verdict = "yes" if main_result["meets_target"] else "NO"
    print(f"\ntargets (aws): RSS <= {RSS_TARGET_MB:g} MB, CPU <= {CPU_TARGET_PCT:g} %: {verdict}; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
