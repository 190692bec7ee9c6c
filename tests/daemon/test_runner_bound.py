"""Detection after a fault burst is bounded by the interval, not by the backoff (issue 8 §1).

Each platform's real watchers poll the real simulator through a Runner; the fault makes N polls in a
row fail; then the scheduled backoff is read (with the jitter pinned at its maximum) and must not
exceed the watcher's cap: its interval for a path that can raise a termination notice, the long
``backoff_max`` only for advisory paths. No wall-clock assertions: the bound logic itself is checked.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from spotguard_daemon.core.settings import Settings
from spotguard_daemon.simulator import Simulator
from spotguard_daemon.core.watchers.detect import build_watchers
from spotguard_daemon.core.watchers.runner import Runner, backoff_cap

INTERVAL, BACKOFF_MAX = 0.2, 30.0
KINDS = {"aws": "terminate", "gcp": "preempt", "azure": "Preempt", "alibaba": "terminate"}
MODES = ("500", "503", "429", "401", "garbage", "truncated", "hang")


def settings_for(platform: str, url: str) -> Settings:
    section = {"endpoint": url + ("/computeMetadata/v1" if platform == "gcp" else ""), "interval": INTERVAL}
    if platform == "gcp":
        section |= {"long_poll_timeout": 5, "preemptible": "no"}
    if platform == "azure":
        section["first_call_timeout"] = 0.5
    return Settings(**{platform: section}, slurm={"enabled": "no"},
                    runner={"request_timeout": 0.3, "backoff_initial": 0.05, "backoff_max": BACKOFF_MAX})


def pinned_high(lo: float, hi: float) -> float:
    return hi


async def fail_then_heal(platform: str, mode: str, failures: int) -> list[tuple[Runner, list]]:
    """Every watcher of ``platform``: ``failures`` failed polls, then the endpoint heals with an event."""
    with Simulator(platform) as sim:
        async with httpx.AsyncClient() as http:
            settings = settings_for(platform, sim.url)
            seen: dict[str, list] = {}
            runners = [Runner(w, lambda w, s: seen.setdefault(w.name, []).append(list(s)), settings.runner,
                              uniform=pinned_high) for w in build_watchers(settings, http, platform, {})]
            sim.fault(mode)
            for runner in runners:
                for _ in range(failures):
                    assert not await runner.poll_once()
                assert runner.consecutive_failures == failures
                delay = runner.next_delay()
                assert delay <= backoff_cap(runner.watcher, settings.runner)
                if not getattr(runner.watcher, "advisory", False):
                    assert delay <= INTERVAL, f"{runner.watcher.name}: {delay} s after {failures} failures"
            sim.clear()
            sim.schedule(KINDS[platform], in_seconds=0)
            await asyncio.sleep(0.05)
            for runner in runners:
                assert await runner.poll_once() and runner.healthy
            return [(runner, seen.get(runner.watcher.name, [])) for runner in runners]


@pytest.mark.parametrize("platform", sorted(KINDS))
@pytest.mark.parametrize("mode", MODES)
def test_backoff_after_many_failures_stays_within_the_interval(platform, mode):
    failures = 3 if mode == "hang" else 8  # a hang costs a request timeout per poll
    results = asyncio.run(fail_then_heal(platform, mode, failures))
    terminating = [seen for runner, seen in results if not getattr(runner.watcher, "advisory", False)]
    assert any(seen and seen[-1] for seen in terminating), "the healed endpoint's notice was not seen"


def test_only_advisory_paths_back_off_long():
    settings = settings_for("aws", "http://127.0.0.1:9")
    watchers = build_watchers(settings, httpx.AsyncClient(), "aws", {})
    caps = {w.name: backoff_cap(w, settings.runner) for w in watchers}
    assert caps == {"aws.spot": INTERVAL, "aws.rebalance": BACKOFF_MAX, "aws.scheduled": BACKOFF_MAX}


def test_a_short_retry_after_is_honoured_and_a_long_one_cut_to_the_cap():
    async def scenario() -> tuple[float, float]:
        with Simulator("aws") as sim:  # its 429 says Retry-After: 1
            async with httpx.AsyncClient() as http:
                settings = settings_for("aws", sim.url)
                spot, rebalance, _ = build_watchers(settings, http, "aws", {})
                delays = []
                for watcher in (rebalance, spot):
                    runner = Runner(watcher, lambda w, s: None, settings.runner, uniform=lambda lo, hi: lo)
                    sim.fault("429", count=2)
                    assert not await runner.poll_once()
                    delays.append(runner.next_delay())
                return delays[0], delays[1]

    advisory, terminating = asyncio.run(scenario())
    assert advisory == 1.0  # jitter pinned at 0: the wait is the server's Retry-After
    assert terminating == INTERVAL  # a Retry-After beyond the interval would break the bound


@pytest.mark.parametrize("every, warnings", [(60.0, 1), (0.0, 5)])
def test_a_long_fault_logs_one_line_then_one_reminder_per_period(monkeypatch, caplog, every, warnings):
    from spotguard_daemon.core.watchers import runner as runner_module

    monkeypatch.setattr(runner_module, "STILL_FAILING_LOG_SECONDS", every)

    async def scenario() -> None:
        with Simulator("azure") as sim:
            async with httpx.AsyncClient() as http:
                settings = settings_for("azure", sim.url)
                runner = Runner(build_watchers(settings, http, "azure", {})[0], lambda w, s: None,
                                settings.runner)
                sim.fault("503")
                for _ in range(5):
                    assert not await runner.poll_once()

    with caplog.at_level(logging.DEBUG, logger="spotguard_daemon.core.watchers.runner"):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if r.name.endswith("runner") and r.levelno >= logging.INFO]
    assert len(lines) == warnings
    assert all("503" in r.getMessage() for r in lines), [r.getMessage() for r in lines]
