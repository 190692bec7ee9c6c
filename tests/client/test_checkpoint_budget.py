"""The adaptive CPU budget of a background persist (spotguard.checkpoint._budget): its direction,
not its timings. Steps are real (timed sleeps), the throttle is the one the persist threads use."""

from __future__ import annotations

import threading
import time

from spotguard.checkpoint import Checkpointer
from spotguard.checkpoint._budget import BASELINE, FLOOR, WINDOW, Budget


def steps(budget: Budget, n: int, seconds: float) -> None:
    for _ in range(n):
        began = time.perf_counter()
        time.sleep(seconds)
        budget.observe(time.perf_counter() - began)


def test_the_budget_shrinks_while_steps_slow_down_and_grows_while_they_do_not():
    budget = Budget(0.25, cores=8)
    steps(budget, BASELINE, 0.01)  # before the persist: the baseline
    throttle = budget.begin()
    assert throttle.share == 0.25 and throttle.adaptive
    steps(budget, 2 * WINDOW, 0.03)  # the persist slows every step 3x: two decisions, two halvings
    assert throttle.share == budget.share < 0.25 / 2 + 1e-9
    shrunk = budget.share
    steps(budget, 6 * WINDOW, 0.005)  # steps no slower than before: it grows, window after window
    assert throttle.share == budget.share > shrunk * 1.5 ** 5 - 1e-9
    shares = [share for _, _, share in budget.decisions]
    assert shares[1] < shares[0] and all(b > a for a, b in zip(shares[2:], shares[3:]))
    budget.end()
    steps(budget, 3, 0.01)  # between persists: baseline again, and the share learned is kept
    assert budget.begin().share == budget.share


def test_it_never_goes_below_the_floor_and_a_lift_overrides_it():
    budget = Budget(0.25, cores=8)
    steps(budget, WINDOW, 0.005)
    throttle = budget.begin()
    steps(budget, 8 * WINDOW, 0.02)
    assert budget.share == FLOOR == throttle.share
    throttle.lift()  # an emergency save, or a caller waiting: full speed, whatever the steps say
    steps(budget, WINDOW, 0.001)
    assert throttle.share is None and throttle.lifted


def test_without_step_times_the_starting_share_holds():
    budget = Budget(0.25, cores=8)
    throttle = budget.begin()
    steps(budget, 3 * WINDOW, 0.005)  # no baseline (the job's first steps): nothing to steer by
    assert throttle.share == 0.25 and budget.decisions == []


def test_the_checkpointer_steers_its_save_in_flight_by_observed_steps(tmp_path):
    """A real background save: slow steps reported through observe_step shrink its share."""
    import torch

    ck = Checkpointer(tmp_path, keep=1, background_cpu_share=0.25)
    for _ in range(BASELINE):
        ck.observe_step(0.01)
    gate = threading.Event()
    ck.on_commit = lambda info: gate.wait(10)  # hold the save in flight while the steps come
    ck.save(1, {"w": torch.ones(1 << 18)})
    for _ in range(WINDOW):
        ck.observe_step(0.05)
    assert ck._throttle.share == 0.125
    gate.set()
    ck.close()
