"""Detection after a fault burst: from the endpoint healing to the notice reaching the store.

For each platform (aws, gcp, azure, alibaba) and fault mode (500, 503, 429, 401, hang, garbage,
truncated), one in-process simulator (``spotguard_daemon.simulator.Simulator``, real HTTP on a
loopback port) and the platform's real watchers, each driven by a Runner with the default settings
(1 s intervals, ``runner.request_timeout`` 2 s, ``backoff_max`` 30 s). A cycle: the endpoint turns
faulty until the terminating watcher has failed ``--failures`` polls in a row; an interruption is
scheduled and flips while the fault lasts; then the fault is cleared (the heal) and the time from
the heal (``time.time()``) to the first snapshot holding the notice at the runner's sink is taken.

The baseline, in the same run and the same way, is the runner before the bound
(:class:`UncappedRunner`): every path backs off with full jitter up to ``backoff_max`` and
``Retry-After`` is ignored. The bound under test (docs/deploy/platforms.md, "Detection bound after a
fault"): one interval plus the request timeout, 3 s with the defaults.

Log volume: for each platform and mode, the bounded runners poll an endpoint that stays faulty for
``--log-seconds``; every record a daemon at INFO would print (``spotguard*`` at INFO and above,
other loggers at WARNING and above) that the instance's tasks emit is counted (a context variable
tells the instances apart), as lines per minute.

All cycles of one repeat run side by side; repeats run one after the other. ``--quick``: 2 repeats
after 6 failures and 60 s of log; the full run 5 repeats after 8 failures and 180 s.

Exceptions: none escape; an instance that fails is recorded with its ``error`` and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ENDPOINT_PATHS, markdown_table, summarize, write_results  # noqa: E402

from spotguard_daemon.core.settings import Settings  # noqa: E402
from spotguard_daemon.simulator import Simulator  # noqa: E402
from spotguard_daemon.core.watchers.detect import build_watchers  # noqa: E402
from spotguard_daemon.core.watchers.runner import Runner, backoff_delay  # noqa: E402

PLATFORMS = ("aws", "gcp", "azure", "alibaba")
MODES = ("500", "503", "429", "401", "hang", "garbage", "truncated")
KINDS = {"aws": "terminate", "gcp": "preempt", "azure": "Preempt", "alibaba": "terminate"}
BOUND_S = 1.0 + 2.0  # default interval + default request timeout
CYCLE_LIMIT_S = 300.0

_instance: contextvars.ContextVar[str | None] = contextvars.ContextVar("instance", default=None)


class UncappedRunner(Runner):
    """The baseline: the runner before the bound (full jitter up to ``backoff_max`` on every path)."""

    def next_delay(self) -> float:
        return backoff_delay(self.consecutive_failures, self._settings, self._uniform)


class LineCounter(logging.Handler):
    """Counts, per instance, the records a daemon at INFO would print."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        key = _instance.get()
        floor = logging.INFO if record.name.startswith("spotguard") else logging.WARNING
        if key is not None and record.levelno >= floor:
            self.counts[key] += 1


class Instance:
    """One simulator and the platform's watchers, each under a runner of ``runner_cls``."""

    def __init__(self, platform: str, sim: Simulator, http: httpx.AsyncClient, runner_cls: type[Runner]) -> None:
        section: dict[str, Any] = {"endpoint": sim.url + ENDPOINT_PATHS[platform]}
        if platform == "gcp":
            section["preemptible"] = "no"  # the 24 h walltime watcher has nothing to do with faults
        settings = Settings(**{platform: section}, slurm={"enabled": "no"})
        self.sim, self.received = sim, asyncio.Event()
        self.received_at = 0.0
        self.runners = [runner_cls(w, self._sink, settings.runner) for w in build_watchers(settings, http, platform, {})]
        self.main = self.runners[0]  # the terminating watcher comes first for every platform
        self.tasks = [asyncio.create_task(r.run()) for r in self.runners]

    def _sink(self, watcher: Any, snapshot: Any) -> None:
        if snapshot and not getattr(watcher, "advisory", False) and not self.received.is_set():
            self.received_at = time.time()
            self.received.set()

    async def until(self, check: Any, limit: float = CYCLE_LIMIT_S) -> None:
        deadline = time.monotonic() + limit
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {limit:.0f} s")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def detection(platform: str, mode: str, runner_cls: type[Runner], failures: int) -> dict[str, Any]:
    """One cycle: ``failures`` failed polls, a flipped event, the heal; ms from heal to notice."""
    with Simulator(platform) as sim:
        async with httpx.AsyncClient() as http:
            inst = None
            try:
                inst = Instance(platform, sim, http, runner_cls)
                await inst.until(lambda: inst.main.polls >= 1, 30)
                sim.fault(mode)
                await inst.until(lambda: inst.main.consecutive_failures >= failures)
                event_id = sim.schedule(KINDS[platform], in_seconds=0)["id"]
                await inst.until(lambda: _flipped(sim, event_id), 10)
                healed = time.time()
                sim.clear("faults")
                await asyncio.wait_for(inst.received.wait(), CYCLE_LIMIT_S)
                return {"ms": (inst.received_at - healed) * 1000.0}
            except Exception as exc:  # noqa: BLE001 - one failed cycle must not end the run
                return {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                if inst is not None:
                    await inst.stop()


def _flipped(sim: Simulator, event_id: str) -> bool:
    return any(e["id"] == event_id and e["flipped_at"] is not None for e in sim.state()["events"])


async def log_volume(platform: str, mode: str, seconds: float, counter: LineCounter) -> float:
    """Lines per minute printed while the endpoint stays faulty for ``seconds``."""
    key = f"{platform}/{mode}"
    _instance.set(key)  # this task's context; the runner tasks created below inherit it
    with Simulator(platform) as sim:
        async with httpx.AsyncClient() as http:
            sim.fault(mode)
            inst = Instance(platform, sim, http, Runner)
            await asyncio.sleep(seconds)
            await inst.stop()
            sim.clear()
    return counter.counts[key] * 60.0 / seconds


async def run_all(repeats: int, failures: int, log_seconds: float, platforms: list[str],
                  modes: list[str]) -> dict[str, Any]:
    counter = LineCounter()
    logging.getLogger().addHandler(counter)
    logging.getLogger().setLevel(logging.DEBUG)
    for noisy in ("httpx", "httpcore", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    combos = [(p, m) for p in platforms for m in modes]
    variants = {"bounded": Runner, "baseline": UncappedRunner}
    samples: dict[str, dict[str, list]] = {v: {f"{p}/{m}": [] for p, m in combos} for v in variants}
    logs = asyncio.gather(*(log_volume(p, m, log_seconds, counter) for p, m in combos))
    for _ in range(repeats):
        jobs = [(v, p, m) for v in variants for p, m in combos]
        results = await asyncio.gather(*(detection(p, m, variants[v], failures) for v, p, m in jobs))
        for (v, p, m), result in zip(jobs, results):
            samples[v][f"{p}/{m}"].append(result)
    per_minute = dict(zip((f"{p}/{m}" for p, m in combos), await logs))
    return {"samples": samples, "log_lines_per_minute": per_minute}


def summarize_results(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant, combos in raw["samples"].items():
        out[variant] = {}
        for key, results in combos.items():
            ms = [r["ms"] for r in results if "ms" in r]
            errors = [r["error"] for r in results if "error" in r]
            out[variant][key] = {**summarize(ms), "samples_ms": [round(x, 1) for x in ms], "errors": errors}
    return out


def table(summary: dict[str, Any], per_minute: dict[str, float]) -> str:
    rows = []
    for key, bounded in summary["bounded"].items():
        base = summary["baseline"][key]
        platform, mode = key.split("/")
        rows.append([platform, mode, bounded["n"], *(_s(bounded, f) for f in ("p50_ms", "p99_ms", "max_ms")),
                     *(_s(base, f) for f in ("p50_ms", "p99_ms", "max_ms")), f"{per_minute[key]:.1f}"])
    return markdown_table(["platform", "fault", "n", "p50 s", "p99 s", "max s", "baseline p50 s",
                           "baseline p99 s", "baseline max s", "log lines/min"], rows)


def _s(stats: dict[str, Any], field: str) -> str:
    return f"{stats[field] / 1000:.2f}" if field in stats else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats, 6 failures, 60 s of log")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--failures", type=int)
    parser.add_argument("--log-seconds", type=float)
    parser.add_argument("--platforms", default=",".join(PLATFORMS), help="comma-separated subset")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    failures = args.failures or (6 if args.quick else 8)
    log_seconds = args.log_seconds or (60.0 if args.quick else 180.0)
    started = time.monotonic()
    raw = asyncio.run(run_all(repeats, failures, log_seconds, args.platforms.split(","), args.modes.split(",")))
    summary = summarize_results(raw)
    worst = max((s.get("max_ms", 0) for s in summary["bounded"].values()), default=0) / 1000
    data = {"parameters": {"repeats": repeats, "failures": failures, "log_seconds": log_seconds,
                           "bound_s": BOUND_S, "seconds": round(time.monotonic() - started, 1)},
            "results": summary, "log_lines_per_minute": raw["log_lines_per_minute"],
            "worst_bounded_s": round(worst, 3), "bound_met": worst <= BOUND_S}
    path = write_results("detection", data, args.out)
    print(table(summary, raw["log_lines_per_minute"]))
    print(f"\nworst heal -> notice with the bound: {worst:.2f} s (bound {BOUND_S:g} s); results in {path}")


if __name__ == "__main__":
    main()
