"""Chaos: SIGKILL the example at 40 random instants; every relaunch of the identical command
resumes from a committed checkpoint at or after the previous one, and the final state is
bit-identical to an uninterrupted run.

Saves come every second step of a few milliseconds, so the background write, the fsyncs, the
commit rename and the retention deletes are in progress most of the time and random kill instants
land inside them (the test checks that some kills left a half-written ``.tmp-step-*`` behind).
Two independent chains (own seed, own checkpoint root) run side by side to keep the wall time
near two minutes on two cores: the cost is dominated by interpreter and torch start-up (several
times that while the other pytest worker runs torchrun jobs, hence the generous timeout).
"""

from __future__ import annotations

import random
import signal
import threading
from pathlib import Path

import pytest

from _example import Proc, final, isolated_env, run_to_end

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 2000
"""Long enough that 20 kills, each at most KILL_WITHIN seconds into a life, never finish the job."""
KILLS_PER_CHAIN = 20
KILL_WITHIN = 0.3
ARGS = ("--save-every", "2", "--step-sleep", "0.003")


def chain(root: Path, seed: int, report: dict) -> None:
    """Kill and relaunch KILLS_PER_CHAIN times, then run to the end; fills ``report``."""
    rng, env, ckpt = random.Random(seed), isolated_env(root / "rt"), root / "ckpt"
    floor, starts, torn = 0, [], 0
    for _ in range(KILLS_PER_CHAIN):
        proc = Proc.example(ckpt, STEPS, *ARGS, env=env)
        started = proc.wait_line(r"start step=(\d+)|final step=", 60)
        assert started[1] is not None, f"the job finished before its {len(starts) + 1}th kill"
        start = int(started[1])
        assert start >= floor, f"resumed at {start}, but step {floor} was committed:\n{proc.output}"
        threading.Event().wait(rng.uniform(0.0, KILL_WITHIN))
        proc.popen.send_signal(signal.SIGKILL)
        proc.finish(30)
        assert "Traceback" not in proc.output and "skipping checkpoint" not in proc.output, proc.output
        committed = [int(m[1]) for m in proc.grab(r"checkpoint step=(\d+)")]
        floor = max([floor, start, *committed])
        torn += any(p.name.startswith(".tmp-step-") for p in ckpt.iterdir())
        starts.append(start)
    last = run_to_end(ckpt, STEPS, *ARGS, env=env, timeout=120)
    resumed = int(last.wait_line(r"start step=(\d+)", 1)[1]) if last.grab("start step=") else STEPS
    assert resumed >= floor and "skipping checkpoint" not in last.output
    report.update(starts=starts, torn=torn, final=final(last))


def test_sigkill_at_random_instants_then_resume_is_bit_identical(tmp_path):
    reports: list[dict] = [{}, {}]
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            chain(tmp_path / f"chain{i}", seed=1000 + i, report=reports[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    reference = run_to_end(tmp_path / "ref", STEPS, "--save-every", "1000",
                           env=isolated_env(tmp_path / "rt-ref"), timeout=120)
    for t in threads:
        t.join()  # bounded by the chains' own waits and the test's timeout
    if errors:
        raise errors[0]
    for report in reports:
        assert report["final"] == final(reference)
        assert report["starts"] == sorted(report["starts"]) and report["starts"][-1] > 0
        assert report["torn"] >= 2, report  # some kills landed inside a save
    assert sum(len(r["starts"]) for r in reports) == 2 * KILLS_PER_CHAIN
    print("chaos:", [{k: r[k] for k in ("starts", "torn")} for r in reports])  # shown with -s
