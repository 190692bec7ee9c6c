"""Chaos: SIGKILL the example at 20 random instants; every relaunch of the identical command
resumes from a committed checkpoint at or after the previous one, and the final state is
bit-identical to an uninterrupted run.

Saves come every second step of 10 ms, so the background write, the fsyncs, the commit rename and
the retention deletes are in progress much of the time and random kill instants land inside them.
Every fourth life is killed the instant a half-written ``.tmp-step-*`` shows in its directory
instead (at a random instant when none does in time), so that kills inside a save are certain, not
a matter of luck (16 random kills left 1 to 5 behind); the test checks that some did. Each life is a fresh
process forked by a JobServer (tests/client/_jobserver.py) that imported torch once, so no life
pays an interpreter and torch start-up; the uninterrupted reference runs beside the lives from a second server.
tests/client/test_resume_chaos.py kills a loader with workers the same way.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from _example import example_args, isolated_env
from _jobserver import JobServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, KILLS, KILL_WITHIN, AIMED = 700, 20, 0.3, 4
"""A life trains at most KILL_WITHIN s after its start, 30 steps of >= 10 ms: 20 lives (600 steps)
can never finish the job, and the last life, saving every second step, has at most 700 to run.
Every AIMED-th life is killed inside a save (see the module docstring)."""
ARGS = ("--save-every", "2", "--step-sleep", "0.01")
FINAL = r"final step=(\d+) digest=([0-9a-f]{64})"


def wait_line(out: Path, pattern: str, timeout: float = 60.0) -> re.Match:
    """The first match of ``pattern`` in the life's output file, once it is there."""
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, out.read_text() if out.exists() else "")):
        assert time.monotonic() < deadline, f"no line matching {pattern!r} within {timeout:.0f} s"
        time.sleep(0.01)
    return found


def inside_a_save(ckpt: Path, within: float) -> None:
    """Return the instant a save's ``.tmp-step-*`` directory shows in ``ckpt`` (or after ``within`` s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if ckpt.is_dir() and any(e.name.startswith(".tmp-step-") for e in os.scandir(ckpt)):
            return
        time.sleep(0.0002)


def chain(server: JobServer, root: Path, seed: int) -> dict:
    """Kill and relaunch KILLS times, then run to the end; return what happened."""
    rng, env, ckpt = random.Random(seed), isolated_env(root / "rt"), root / "ckpt"
    argv = example_args(ckpt, STEPS, *ARGS)
    root.mkdir()
    floor, starts, torn = 0, [], 0
    for life in range(1, KILLS + 1):
        out = root / f"life{life}.out"  # a file each: the new life may not have truncated an old one yet
        pid = server.start(argv, env, out)
        started = wait_line(out, r"start step=(\d+)|final step=")
        assert started[1] is not None, f"the job finished before its {life}th kill"
        start = int(started[1])
        assert start >= floor, f"resumed at {start}, but step {floor} was committed:\n{out.read_text()}"
        at = rng.uniform(0.0, KILL_WITHIN)
        if life % AIMED == 0:
            inside_a_save(ckpt, KILL_WITHIN)
        else:
            threading.Event().wait(at)
        os.kill(pid, signal.SIGKILL)
        assert server.wait() == -signal.SIGKILL, out.read_text()
        output = out.read_text()
        assert "Traceback" not in output and "skipping checkpoint" not in output, output
        committed = [int(m) for m in re.findall(r"checkpoint step=(\d+)", output)]
        floor = max([floor, start, *committed])
        torn += any(p.name.startswith(".tmp-step-") for p in ckpt.iterdir())
        starts.append(start)
    out = root / "last.out"
    assert server.run(argv, env, out) == 0, out.read_text()
    output = out.read_text()
    resumed = re.search(r"start step=(\d+)", output)
    assert (int(resumed[1]) if resumed else STEPS) >= floor and "skipping checkpoint" not in output
    return {"starts": starts, "torn": torn, "final": re.search(FINAL, output).groups()}


def test_sigkill_at_random_instants_then_resume_is_bit_identical(tmp_path):
    server, beside = JobServer(), JobServer()
    ref_out = tmp_path / "ref.out"
    try:
        beside.start(example_args(tmp_path / "ref", STEPS, "--save-every", "1000"),
                     isolated_env(tmp_path / "rt-ref"), ref_out)
        report = chain(server, tmp_path / "chain", seed=1000)
        assert beside.wait() == 0, ref_out.read_text()
    finally:
        server.close()
        beside.close()
    assert report["final"] == re.search(FINAL, ref_out.read_text()).groups()
    assert report["starts"] == sorted(report["starts"]) and report["starts"][-1] > 0
    assert len(report["starts"]) == KILLS
    assert report["torn"] >= 2, report  # some kills landed inside a save
    print("chaos:", {k: report[k] for k in ("starts", "torn")})  # shown with -s
