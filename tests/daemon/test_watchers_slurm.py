"""Slurm walltime: real subprocesses (fake squeue/scontrol scripts on PATH), local-time parsing."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime, timezone

import pytest
from spotguard.protocol import Kind
from spotguard_daemon.core.settings import RunnerSettings, Settings
from spotguard_daemon.core.watchers.base import WatcherError
from spotguard_daemon.core.watchers.runner import Runner
from spotguard_daemon.core.watchers.slurm import SlurmWalltimeWatcher, parse_end_time


def local(ts: float) -> str:
    """How squeue prints a time under the watcher's TZ=UTC0: naive, whole seconds."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def script(path, body):
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o700)


@pytest.fixture
def slurm(tmp_path):
    """A bin dir on PATH with a squeue that prints the content of ``end`` and logs its argv."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "end").write_text("N/A\n")
    script(bindir / "squeue", f'echo "$@" >> {tmp_path}/argv\necho "$TZ $SLURM_TIME_FORMAT" > {tmp_path}/env\n'
                              f'cat {tmp_path}/end')
    environ = {"SLURM_JOB_ID": "42", "PATH": f"{bindir}:/usr/bin:/bin", "TZ": "EST5",
               "SLURM_TIME_FORMAT": "relative"}
    return tmp_path, environ


def watcher(environ, lead=300.0, interval=60.0, timeout=None):
    settings = Settings(slurm={"lead": lead, "interval": interval})
    return SlurmWalltimeWatcher(settings, environ, command_timeout=timeout)


def test_parse_end_time():
    assert parse_end_time("N/A") is None and parse_end_time("Unknown") is None
    ts = 1_900_000_000
    assert parse_end_time(local(ts)) == datetime.fromtimestamp(ts, timezone.utc)
    assert parse_end_time("2026-11-21T15:30:00-05:00") == datetime(2026, 11, 21, 20, 30, tzinfo=timezone.utc)


def test_no_limit_means_no_notice(slurm):
    tmp_path, environ = slurm
    w = watcher(environ)
    assert asyncio.run(w.poll()) == []
    assert (tmp_path / "argv").read_text().split() == ["-h", "-j", "42", "-o", "%e"]
    assert (tmp_path / "env").read_text().split() == ["UTC0", "standard"]  # whatever the user set


def test_notice_appears_lead_seconds_before_the_end_and_is_stable(slurm):
    tmp_path, environ = slurm
    end = int(time.time()) + 1000
    (tmp_path / "end").write_text(local(end) + "\n")
    far = watcher(environ, lead=300)
    assert asyncio.run(far.poll()) == []
    assert far.interval == 60  # far from the lead: the normal interval

    near = watcher(environ, lead=1200)

    async def twice():
        return await near.poll(), await near.poll()

    first, second = asyncio.run(twice())
    assert len(first) == 1 and first == second
    notice = first[0]
    assert notice.kind is Kind.WALLTIME and notice.terminating and notice.platform == "slurm"
    assert notice.deadline == datetime.fromtimestamp(end, timezone.utc)
    assert notice.id.startswith("slurm:walltime:42:")


def test_extended_time_limit_replaces_the_notice(slurm):
    tmp_path, environ = slurm
    w = watcher(environ, lead=600)
    end = int(time.time()) + 100

    async def scenario():
        (tmp_path / "end").write_text(local(end))
        before = await w.poll()
        (tmp_path / "end").write_text(local(end + 300))
        moved = await w.poll()
        (tmp_path / "end").write_text(local(end + 3600))
        extended = await w.poll()
        return before, moved, extended

    before, moved, extended = asyncio.run(scenario())
    assert len(before) == len(moved) == 1 and before[0].id != moved[0].id
    assert extended == []


def test_interval_shrinks_so_the_notice_is_on_time(slurm):
    tmp_path, environ = slurm
    (tmp_path / "end").write_text(local(time.time() + 3))
    w = watcher(environ, lead=1.6, interval=60)  # end - lead is between 0.4 and 1.4 s from now
    got = []

    async def main():
        task = asyncio.create_task(Runner(w, lambda _, s: got.append((time.monotonic(), s)),
                                          RunnerSettings()).run())
        start = time.monotonic()
        while not any(s for _, s in got) and time.monotonic() - start < 4:
            await asyncio.sleep(0.02)
        task.cancel()
        return start

    start = asyncio.run(main())
    first = next(t for t, s in got if s)
    assert first - start < 2.0  # with a fixed 60 s interval it would take a minute


def test_scontrol_fallback_when_squeue_fails(slurm):
    tmp_path, environ = slurm
    script(tmp_path / "bin" / "squeue", "echo 'slurm_load_jobs error' >&2; exit 1")
    end = int(time.time()) + 10
    script(tmp_path / "bin" / "scontrol",
           f'echo "JobId=42 JobName=train"\necho "   StartTime=2026-01-01T00:00:00 EndTime={local(end)} Deadline=N/A"')
    notices = asyncio.run(watcher(environ, lead=60).poll())
    assert [n.deadline for n in notices] == [datetime.fromtimestamp(end, timezone.utc)]


def test_missing_commands_are_a_watcher_error(tmp_path):
    environ = {"SLURM_JOB_ID": "42", "PATH": str(tmp_path)}
    with pytest.raises(WatcherError):
        asyncio.run(watcher(environ).poll())


def test_garbage_output_is_a_watcher_error(slurm):
    tmp_path, environ = slurm
    (tmp_path / "end").write_text("tomorrow-ish\n")
    with pytest.raises(WatcherError):
        asyncio.run(watcher(environ).poll())


def test_hanging_squeue_is_killed_within_the_timeout(slurm):
    tmp_path, environ = slurm
    script(tmp_path / "bin" / "squeue", f"echo $$ > {tmp_path}/pid\nexec sleep 30")
    started = time.monotonic()
    with pytest.raises(WatcherError, match="did not answer"):
        asyncio.run(watcher(environ, timeout=0.3).poll())
    assert time.monotonic() - started < 3
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
