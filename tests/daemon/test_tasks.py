"""The daemon's task supervisor: a loop that fails is logged, counted and started again, never fatal."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Counter
from spotguard_daemon.core.tasks import Supervisor


def counter() -> Counter:
    return Counter("t_failures_total", "", ["task"], registry=CollectorRegistry())


def test_a_failing_loop_is_restarted_with_backoff_logged_once_per_cause_and_counted(caplog):
    runs: list[float] = []

    async def flaky() -> None:
        runs.append(asyncio.get_running_loop().time())
        if len(runs) <= 3:
            raise ValueError("step 9223372036854775808 is too large")
        if len(runs) == 4:
            return  # a loop that ends by itself is a failure too
        await asyncio.sleep(3600)

    async def main() -> Supervisor:
        tasks = Supervisor(failures, first=0.05, ceiling=0.1)
        tasks.keep("housekeeping", flaky)
        for _ in range(200):
            if len(runs) >= 5:
                break
            await asyncio.sleep(0.01)
        await tasks.cancel_all()
        return tasks

    failures = counter()
    with caplog.at_level(logging.ERROR, logger="spotguard_daemon.core.tasks"):
        tasks = asyncio.run(main())
    assert len(runs) == 5 and not tasks.tasks
    gaps = [b - a for a, b in zip(runs, runs[1:])]
    assert gaps[0] >= 0.05 and all(gap >= 0.1 for gap in gaps[1:]), gaps  # doubling, up to the ceiling
    assert failures.labels(task="housekeeping")._value.get() == 4
    failed = [r for r in caplog.records if "failed (ValueError: step" in r.getMessage()]
    assert len(failed) == 3 and failed[0].exc_info and not any(r.exc_info for r in failed[1:])
    assert "starting it again in 0.05 s" in failed[0].getMessage()
    assert any("housekeeping ended by itself" in r.getMessage() for r in caplog.records)


def test_a_one_shot_task_that_fails_is_logged_and_counted_and_nothing_else_stops(caplog):
    async def boom() -> None:
        raise RuntimeError("the store said no")

    async def main() -> None:
        tasks = Supervisor(failures)
        tasks.once("storage-check", boom())
        await asyncio.sleep(0.05)
        assert not tasks.tasks

    failures = counter()
    with caplog.at_level(logging.ERROR, logger="spotguard_daemon.core.tasks"):
        asyncio.run(main())
    assert failures.labels(task="storage-check")._value.get() == 1
    assert "daemon task storage-check failed (RuntimeError: the store said no)" in caplog.text
