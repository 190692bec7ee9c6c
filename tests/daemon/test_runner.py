"""The runner: pacing, backoff bounds, error classes, logging once per state change, no escapes."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from spotguard.protocol import Kind, Notice
from spotguard_daemon.core.settings import RunnerSettings
from spotguard_daemon.core.watchers.base import BadPayload, WatcherError
from spotguard_daemon.core.watchers.runner import Runner, backoff_delay, classify

FAST = RunnerSettings(request_timeout=0.5, backoff_initial=0.01, backoff_max=0.05)


class ScriptedWatcher:
    """A watcher whose polls follow a script: a list of notices to return, or an exception to raise."""

    platform = "test"
    name = "test.scripted"

    def __init__(self, script, interval=0.02, poll_seconds=0.0, poll_timeout=None):
        self.script, self.interval, self.poll_seconds = list(script), interval, poll_seconds
        self.starts: list[float] = []
        if poll_timeout is not None:
            self.poll_timeout = poll_timeout

    async def poll(self):
        self.starts.append(time.monotonic())
        step = self.script.pop(0) if self.script else []
        if self.poll_seconds:
            await asyncio.sleep(self.poll_seconds)
        if isinstance(step, BaseException):
            raise step
        return step

    async def aclose(self):
        pass


class Recorder:
    def __init__(self):
        self.outcomes: list[str] = []

    def poll_done(self, watcher, outcome, seconds):
        assert seconds >= 0
        self.outcomes.append(outcome)


def notice(i="n1"):
    return Notice(id=i, platform="test", kind=Kind.DRILL)


async def run_for(runner: Runner, seconds: float) -> None:
    task = asyncio.create_task(runner.run())
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_backoff_grows_doubles_and_is_capped():
    settings = RunnerSettings(backoff_initial=0.5, backoff_max=30)
    upper = [backoff_delay(n, settings, uniform=lambda lo, hi: hi) for n in range(1, 12)]
    assert upper[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(upper) == 30.0 and upper[-1] == 30.0
    assert all(backoff_delay(n, settings, uniform=lambda lo, hi: lo) == 0.0 for n in range(1, 5))
    real = [backoff_delay(n, settings) for n in range(1, 200)]
    assert all(0 <= d <= 30 for d in real)
    assert backoff_delay(10_000, settings, uniform=lambda lo, hi: hi) == 30.0  # no overflow


def test_classify_covers_the_outcome_set():
    request = httpx.Request("GET", "http://127.0.0.1/x")
    status = httpx.HTTPStatusError("x", request=request, response=httpx.Response(503, request=request))
    assert classify(status) == "http_error"
    assert classify(httpx.ReadTimeout("t", request=request)) == "timeout"
    assert classify(TimeoutError()) == "timeout"
    assert classify(httpx.ConnectError("refused", request=request)) == "connect_error"
    assert classify(httpx.RemoteProtocolError("truncated", request=request)) == "http_error"
    assert classify(BadPayload("x")) == "bad_payload"
    assert classify(WatcherError("x")) == "error"
    assert classify(KeyError("x")) == "error"


def test_pacing_is_drift_free_despite_slow_polls():
    watcher = ScriptedWatcher([], interval=0.05, poll_seconds=0.03)
    asyncio.run(run_for(Runner(watcher, lambda w, s: None, FAST), 0.53))
    gaps = [b - a for a, b in zip(watcher.starts, watcher.starts[1:])]
    assert 9 <= len(watcher.starts) <= 12  # a drifting loop (0.08 s per poll) would manage 7
    assert sum(gaps) / len(gaps) == pytest.approx(0.05, abs=0.01)


def test_sink_gets_snapshots_only_after_success_and_nothing_escapes(caplog):
    boom = [WatcherError("down"), KeyError("bug"), BadPayload("junk"), ValueError("x")]
    watcher = ScriptedWatcher([[notice()], *boom, [notice()], []], interval=0.01)
    seen, recorder = [], Recorder()
    runner = Runner(watcher, lambda w, s: seen.append([n.id for n in s]), FAST, recorder)
    with caplog.at_level(logging.DEBUG, logger="spotguard_daemon.core.watchers.runner"):
        asyncio.run(run_for(runner, 0.6))
    assert seen[:3] == [["n1"], ["n1"], []]  # failures hand nothing to the sink: no false cancel
    assert recorder.outcomes[:7] == ["ok", "error", "error", "bad_payload", "error", "ok", "ok"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    recoveries = [r for r in caplog.records if "recovered after 4" in r.getMessage()]
    assert len(warnings) == 1 and "down" in warnings[0].getMessage()
    assert len(recoveries) == 1 and runner.healthy and runner.consecutive_failures == 0


def test_consecutive_failures_counted_and_backed_off():
    watcher = ScriptedWatcher([WatcherError("x")] * 1000, interval=0.001)
    watcher.advisory = True  # an advisory path backs off to backoff_max (a notice path: its interval)
    settings = RunnerSettings(request_timeout=0.5, backoff_initial=0.02, backoff_max=0.08)
    runner = Runner(watcher, lambda w, s: None, settings)
    asyncio.run(run_for(runner, 0.6))
    assert not runner.healthy and runner.consecutive_failures == len(watcher.starts)
    assert "x" in runner.last_error
    # full jitter averages cap/2 = 0.04 s once capped: far fewer than the 600 an unpaced loop makes
    assert 5 <= len(watcher.starts) <= 60


def test_a_hanging_poll_is_cut_by_the_poll_timeout():
    watcher = ScriptedWatcher([[notice()]] * 100, interval=0.01, poll_seconds=10, poll_timeout=0.1)
    recorder = Recorder()
    runner = Runner(watcher, lambda w, s: None, FAST, recorder)
    asyncio.run(run_for(runner, 0.45))
    assert recorder.outcomes and set(recorder.outcomes) == {"timeout"}
    assert 2 <= len(recorder.outcomes) <= 4


def test_sink_and_observer_bugs_do_not_stop_the_loop():
    class BadObserver:
        def poll_done(self, *a):
            raise RuntimeError("metrics bug")

    def bad_sink(w, s):
        raise RuntimeError("store bug")

    watcher = ScriptedWatcher([], interval=0.01)
    runner = Runner(watcher, bad_sink, FAST, BadObserver())
    asyncio.run(run_for(runner, 0.2))
    assert len(watcher.starts) >= 5 and runner.healthy


def test_cancellation_leaves_promptly_even_mid_poll():
    watcher = ScriptedWatcher([], interval=0.01, poll_seconds=30, poll_timeout=60)

    async def main():
        task = asyncio.create_task(Runner(watcher, lambda w, s: None, FAST).run())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - started

    assert asyncio.run(main()) < 0.5
