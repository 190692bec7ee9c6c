"""The learned MTBF: the Gamma-Poisson estimate (spotguard.cadence.learned_mtbf), the Cadence that
follows it, the nodes a launcher names, and the bounds of the daemon's JobRate on the wire."""

from __future__ import annotations

import logging
import random

import pytest
from pydantic import ValidationError

from spotguard import cadence as cad
from spotguard.cadence import Cadence, job_nodes, learned_mtbf
from spotguard.guard import _job_rate
from spotguard.protocol import JobRate, ProgressRequest, decode_request, encode

HOUR = 3600.0


def test_without_observations_the_estimate_is_the_prior():
    assert learned_mtbf(6 * HOUR, 0, 0.0) == 6 * HOUR
    assert learned_mtbf(6 * HOUR, 0, 0.0, prior_weight=5) == 6 * HOUR


def test_the_estimate_is_the_posterior_mean_rate_inverted():
    # Gamma(w, w*M0) prior, n events in t seconds -> Gamma(w + n, w*M0 + t); M = 1/E[rate]
    assert learned_mtbf(6 * HOUR, 3, 2 * HOUR, prior_weight=1) == pytest.approx((6 * HOUR + 2 * HOUR) / 4)
    assert learned_mtbf(1000, 2, 500, prior_weight=2, floor_s=1) == pytest.approx((2000 + 500) / 4)


def test_running_without_interruptions_lengthens_the_mtbf():
    assert learned_mtbf(HOUR, 0, 10 * HOUR) == pytest.approx(11 * HOUR)


def test_the_floor_holds_against_a_crash_loop():
    assert learned_mtbf(6 * HOUR, 1000, 100.0) == cad.DEFAULT_MTBF_FLOOR_S
    assert learned_mtbf(6 * HOUR, 1000, 100.0, floor_s=30) == 30


@pytest.mark.parametrize("true_mtbf", [20.0, 600.0, 4 * HOUR])
def test_poisson_interruptions_converge_to_the_true_mtbf_from_a_prior_far_off(true_mtbf):
    rng = random.Random(7)
    running, n = 0.0, 0
    for _ in range(400):
        running += rng.expovariate(1 / true_mtbf)
        n += 1
    for prior in (true_mtbf / 20, true_mtbf * 20):
        estimate = learned_mtbf(prior, n, running, floor_s=1e-3)
        assert estimate == pytest.approx(true_mtbf, rel=0.15)


def test_a_learned_interval_near_the_true_mtbf_wastes_within_a_percent_of_the_optimum():
    m, c = 30.0, 0.5
    best = cad.expected_waste(cad.daly_interval(m, c), m, c)
    guess = 4 * m  # a prior 4x too long pulls as much as 4 interruptions' worth of running time
    learned = learned_mtbf(guess, 20, 20 * m, floor_s=1)
    assert learned == pytest.approx(24 / 21 * m)
    assert cad.expected_waste(cad.daly_interval(learned, c), m, c) < best * 1.01
    assert cad.expected_waste(cad.daly_interval(guess, c), m, c) > best * 1.2


@pytest.mark.parametrize("kwargs", [
    dict(prior_mtbf_s=0, interruptions=0, running_s=0),
    dict(prior_mtbf_s=HOUR, interruptions=-1, running_s=0),
    dict(prior_mtbf_s=HOUR, interruptions=1.5, running_s=0),
    dict(prior_mtbf_s=HOUR, interruptions=True, running_s=0),
    dict(prior_mtbf_s=HOUR, interruptions=0, running_s=-1),
    dict(prior_mtbf_s=HOUR, interruptions=0, running_s=float("nan")),
    dict(prior_mtbf_s=HOUR, interruptions=0, running_s=0, prior_weight=0),
    dict(prior_mtbf_s=HOUR, interruptions=0, running_s=0, floor_s=float("inf")),
])
def test_bad_estimator_input_is_refused(kwargs):
    with pytest.raises(ValueError):
        learned_mtbf(**kwargs)


def _rate(mtbf_s: float, **extra) -> JobRate:
    fields = dict(job_id="j", mtbf_s=mtbf_s, prior_mtbf_s=6 * HOUR, prior_weight=1.0, floor_s=60.0,
                  interruptions=3, running_s=1000.0, nodes=1)
    return JobRate(**{**fields, **extra})


def test_cadence_follows_a_new_rate_and_replans_the_interval(caplog):
    cadence = Cadence(cost_s=2.0)
    cadence.observe_step(0.1)
    before = cadence.steps
    with caplog.at_level(logging.INFO, logger="spotguard.cadence"):
        cadence.follow(_rate(600.0))
    assert cadence.mtbf_s == 600.0 and cadence.mtbf_source == "learned"
    assert cadence.interval_s == pytest.approx(cad.daly_interval(600.0, 2.0))
    assert cadence.steps == cad.steps_between(cadence.interval_s, 0.1) < before
    assert "job MTBF learned by the daemon: 600 s (3 interruptions" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="spotguard.cadence"):
        cadence.follow(_rate(620.0))  # within 10 %: taken, not logged
    assert cadence.mtbf_s == 620.0 and caplog.text == ""
    cadence.follow(None)
    assert cadence.mtbf_s == 620.0


def test_a_cadence_built_not_to_learn_keeps_its_mtbf():
    cadence = Cadence(mtbf_s=HOUR, learn=False)
    cadence.follow(_rate(600.0))
    assert cadence.mtbf_s == HOUR and cadence.mtbf_source == "given"


def test_job_nodes_is_world_size_over_local_world_size():
    assert job_nodes({}) == 1
    assert job_nodes({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert job_nodes({"WORLD_SIZE": "4"}) == 1
    for bad in ({"WORLD_SIZE": "x"}, {"WORLD_SIZE": "0", "LOCAL_WORLD_SIZE": "0"},
                {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "-2"}):
        assert job_nodes(bad) == 1


def test_a_job_rate_out_of_the_wire_bounds_is_ignored_by_the_client():
    good = _rate(600.0).model_dump()
    assert _job_rate(good) == _rate(600.0)
    assert _job_rate(None) is None
    for bad in ({**good, "mtbf_s": 1e300}, {**good, "mtbf_s": 0}, {**good, "interruptions": -1},
                {**good, "nodes": 0}, {**good, "extra": 1}, {**good, "running_s": float("inf")}, "x"):
        assert _job_rate(bad) is None


def test_progress_carries_the_nodes_bounded():
    message = ProgressRequest(pid=1, step=3, at="2026-01-01T00:00:00Z", nodes=4)
    assert decode_request(encode(message)).nodes == 4
    assert decode_request(b'{"type":"progress","pid":1,"step":3,"at":"2026-01-01T00:00:00Z"}').nodes == 1
    with pytest.raises(ValidationError):
        ProgressRequest(pid=1, step=3, at="2026-01-01T00:00:00Z", nodes=0)
