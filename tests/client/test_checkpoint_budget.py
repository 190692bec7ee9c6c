"""The adaptive CPU budget of a background persist (spotguard.checkpoint._budget): its direction,
not its timings. Steps are real (timed sleeps), the throttle is the one the persist threads use."""

from __future__ import annotations

import os
import threading
import time
from functools import partial

import pytest

from spotguard.checkpoint import Checkpointer
from spotguard.checkpoint._budget import (BASELINE, FLOOR, PAUSE_SLACK, SPARE_USE, WINDOW, Budget,
                                         idle_seconds)

approx = partial(pytest.approx, rel=0.05)
"""The idle clock is read a moment after the step's end: on a loaded machine (CI) that moment can be
milliseconds, a percent of the spare measured. The shares compared differ by factors of 1.5 or more."""


def steps(budget: Budget, n: int, seconds: float, persist_cost: float = 0.0) -> list[bool]:
    """``n`` steps of ``seconds``, each ``persist_cost`` longer while a persist runs and is not held
    back (what a persist that costs the loop does); whether each step ran with the persist held."""
    held = []
    for _ in range(n):
        throttle = budget._throttle
        running = throttle is not None and not throttle.paused
        held.append(throttle is not None and not running)
        began = time.perf_counter()
        time.sleep(seconds + (persist_cost if running else 0.0))
        budget.observe(time.perf_counter() - began)
    return held


CYCLE = 3 * WINDOW + 2
"""Steps of one decision to shrink: the window that looked slow, its control window (held back),
then a fresh window with the persist (the first step after each switch is dropped)."""
HELD = [False] * WINDOW + [True] * (WINDOW + 1) + [False] * (WINDOW + 1)
"""Which steps of a cycle run with the persist held back."""


def idle_cores(n: float):
    """The idle seconds of a machine where ``n`` cores stay idle (what /proc/stat would say)."""
    return lambda: n * time.monotonic()


def baseline(budget: Budget) -> None:
    steps(budget, BASELINE, 0.02)  # longer than SAMPLE_EVERY: the spare cores are measured


def test_the_budget_shrinks_while_steps_slow_down_and_grows_while_they_do_not():
    budget = Budget(0.25, cores=8, idle=idle_cores(2))
    baseline(budget)
    throttle = budget.begin()
    assert throttle.share == approx(SPARE_USE * 2) and throttle.adaptive  # it starts from the spare cores
    held = steps(budget, 2 * CYCLE, 0.02, persist_cost=0.04)  # the persist slows every step 3x
    assert held == 2 * HELD  # each slow window gets its control, then a fresh window
    assert throttle.share == budget.share == approx(SPARE_USE * 2 / 4)  # two halvings
    shrunk = budget.share
    steps(budget, 3 * WINDOW, 0.005)  # steps no slower than before: it grows, window after window
    assert throttle.share == budget.share == approx(shrunk * 1.5 ** 3)
    steps(budget, 4 * WINDOW, 0.005)  # and stops at the part of the spare cores it may use
    assert budget.share == approx(SPARE_USE * 2)
    shares = [share for _, _, share in budget.decisions]
    assert shares[1] < shares[0] and all(b > a for a, b in zip(shares[2:6], shares[3:6]))
    budget.end()
    steps(budget, 3, 0.01)  # between persists: baseline again, and the share learned is kept
    assert budget.begin().share == budget.share


def test_a_machine_that_slows_down_by_itself_does_not_shrink_it():
    """Steps slower than before the persist, and as slow while it is held back: that is the machine
    (a neighbour, the clock), not the persist; the control window becomes the reference."""
    budget = Budget(0.25, cores=8, idle=idle_cores(1))
    baseline(budget)
    throttle = budget.begin()
    start = throttle.share
    held = steps(budget, CYCLE, 0.04)  # twice as slow, with or without the persist
    assert held == HELD
    assert budget.share == approx(min(SPARE_USE, start * 1.5)) and not throttle.paused  # not halved
    steps(budget, WINDOW, 0.04)  # as slow as the new reference: no control window, no halving
    assert not throttle.paused and budget.share == approx(SPARE_USE)


def test_a_pause_holds_the_persists_next_piece_of_work_until_resumed_or_lifted():
    from spotguard.checkpoint._workers import Throttle

    for release in ("resume", "lift"):
        throttle, ran = Throttle(0.5, adaptive=True), threading.Event()
        throttle.pause(10)
        worker = threading.Thread(target=throttle.run, args=(ran.set,))
        worker.start()
        assert not ran.wait(0.1) and throttle.paused
        getattr(throttle, release)()  # the control window ends; or an emergency save lifts the cap
        assert ran.wait(5)
        worker.join(5)


def test_a_window_slow_by_chance_does_not_shrink_it():
    """A hiccup (a window slow for its own reasons) starts a control window; the verdict comes from
    a fresh window with the persist, not from the one picked for being slow."""
    budget = Budget(0.25, cores=8, idle=idle_cores(1))
    baseline(budget)
    throttle = budget.begin()
    start = throttle.share
    steps(budget, WINDOW, 0.05)  # the hiccup: slow, whatever the persist does
    assert throttle.paused
    steps(budget, 2 * (WINDOW + 1), 0.02)  # control and check: as fast as before
    assert budget.share == approx(min(SPARE_USE, start * 1.5)) and len(budget.decisions) == 1  # not halved


def test_a_control_window_never_holds_the_persist_longer_than_its_steps_should_take():
    budget = Budget(0.25, cores=8, idle=idle_cores(1))
    steps(budget, BASELINE, 0.005)
    throttle = budget.begin()
    steps(budget, WINDOW, 0.02)  # slow: a control window starts
    assert throttle.paused
    time.sleep((WINDOW + 1) * 2 * budget._reference + PAUSE_SLACK + 0.05)  # the loop went quiet (an eval)
    assert not throttle.paused
    began = time.monotonic()
    throttle.run(lambda: None)  # the persist's next piece of work is not held
    assert time.monotonic() - began < 0.05
    steps(budget, WINDOW + 1, 0.005)  # no decision from a window that was not a control
    assert budget.decisions == []


def test_a_first_persist_takes_the_spare_cores_only_where_there_are_some():
    busy = Budget(0.25, cores=8, idle=lambda: 0.0)  # the loop and its workers take every core
    baseline(busy)
    assert busy.begin().share == FLOOR  # what it takes there, the loop loses: the least share
    idle = Budget(0.25, cores=8, idle=idle_cores(6))  # a GPU node: the loop mostly waits on the GPU
    baseline(idle)
    assert idle.begin().share == approx(SPARE_USE * 6)
    unknown = Budget(0.25, cores=8, idle=idle_cores(6))
    steps(unknown, 3, 0.001)  # too short a baseline to measure anything: the cautious start
    assert unknown.begin().share == 0.25


def test_where_no_core_is_spare_windows_that_look_fine_do_not_grow_it():
    """A loop on every core: steps no slower with the persist than before it (a 5-step window
    cannot see a cost of a few percent there) leave the share at the floor, window after window."""
    budget = Budget(0.25, cores=2, idle=lambda: 0.0)
    baseline(budget)
    throttle = budget.begin()
    steps(budget, 4 * WINDOW, 0.005)
    assert len(budget.decisions) == 4 and budget.share == throttle.share == FLOOR
    tolerant = Budget(0.25, target=0.10, cores=2, idle=lambda: 0.0)  # background_inflation=0.10
    baseline(tolerant)
    assert tolerant.begin().share == 0.10  # the steps may run 10 % slower: a tenth of a core


def test_the_spare_cores_are_split_over_the_ranks_of_the_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's: four ranks persist at once
    budget = Budget(0.25, cores=8, idle=idle_cores(8))
    baseline(budget)
    assert budget.spare() == approx(2) and budget.begin().share == approx(SPARE_USE * 2)


def test_idle_time_is_read_from_the_kernel():
    cpus = os.sched_getaffinity(0)
    wall0, idle0 = time.monotonic(), idle_seconds(cpus)
    time.sleep(0.3)
    wall1, idle1 = time.monotonic(), idle_seconds(cpus)
    assert idle0 is not None and idle1 is not None
    assert 0 <= idle1 - idle0 <= len(cpus) * (wall1 - wall0) * 1.2
    budget = Budget(0.25)  # the real reading: a spare between the floor and every core
    baseline(budget)
    assert FLOOR <= budget.spare() <= budget.cores * 1.2


def test_it_never_goes_below_the_floor_and_a_lift_overrides_it():
    budget = Budget(0.25, cores=8, idle=idle_cores(8))
    steps(budget, WINDOW, 0.005)
    throttle = budget.begin()
    steps(budget, 4 * CYCLE, 0.005, persist_cost=0.015)
    assert budget.share == FLOOR == throttle.share
    throttle.lift()  # an emergency save, or a caller waiting: full speed, whatever the steps say
    steps(budget, WINDOW, 0.001)
    assert throttle.share is None and throttle.lifted


def test_without_step_times_the_starting_share_holds():
    budget = Budget(0.25, cores=8, idle=idle_cores(8))
    throttle = budget.begin()
    steps(budget, 3 * WINDOW, 0.005)  # no baseline (the job's first steps): nothing to steer by
    assert throttle.share == 0.25 and budget.decisions == []


def test_the_checkpointer_steers_its_save_in_flight_by_observed_steps(tmp_path):
    """A real background save: steps reported slow through observe_step while it runs, and fast
    while it is held back, shrink its share."""
    import torch

    ck = Checkpointer(tmp_path, keep=1, background_cpu_share=0.25)
    for _ in range(BASELINE):
        ck.observe_step(0.01)
    gate = threading.Event()
    ck.on_commit = lambda info: gate.wait(10)  # hold the save in flight while the steps come
    ck.save(1, {"w": torch.ones(1 << 18)})
    for _ in range(WINDOW):
        ck.observe_step(0.05)
    assert ck._throttle.paused  # the control window: is it the save?
    for _ in range(WINDOW + 1):
        ck.observe_step(0.01)  # without it, the steps are as fast as before
    assert not ck._throttle.paused and ck._throttle.share == 0.25
    for _ in range(WINDOW + 1):
        ck.observe_step(0.05)  # and with it again, slow: it is the save
    assert ck._throttle.share == 0.125 and not ck._throttle.paused
    gate.set()
    ck.close()
