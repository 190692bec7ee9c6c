"""spotguard.cadence (Young/Daly and the per-step planner) and the ``spotguard cadence`` command."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from spotguard import cadence as cad
from spotguard.cadence import Cadence
from spotguard_daemon.commands.cadence import cadence as cadence_command

HOUR = 3600.0


def test_young_reference_example_30s_cost_3h_mtbf_is_about_805s():
    assert cad.young_interval(3 * HOUR, 30) == pytest.approx(805.0, abs=0.5)
    assert cad.young_interval(3 * HOUR, 30) == pytest.approx(math.sqrt(2 * 10800 * 30))


def test_daly_matches_the_published_formula_and_sits_just_below_young():
    c, m = 30.0, 3 * HOUR
    x = c / (2 * m)
    expected = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert cad.daly_interval(m, c) == pytest.approx(expected)
    assert cad.daly_interval(m, c) == pytest.approx(785.1, abs=0.1)


def test_daly_is_the_mtbf_once_the_cost_reaches_twice_the_mtbf():
    assert cad.daly_interval(10, 20) == 10
    assert cad.daly_interval(10, 500) == 10
    assert cad.daly_interval(10, 19.99) != 10


def test_job_mtbf_divides_by_nodes():
    assert cad.job_mtbf(6 * HOUR, 4) == 1.5 * HOUR
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="nodes"):
            cad.job_mtbf(HOUR, bad)


def test_steps_between_rounds_down_and_is_at_least_one():
    assert cad.steps_between(805, 1.5) == 536
    assert cad.steps_between(10, 2.5) == 4
    assert cad.steps_between(1, 60) == 1
    assert cad.steps_between(1e308, 1e-300) == 2**62


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_non_positive_or_non_finite_inputs_are_rejected(bad):
    for call in (lambda: cad.young_interval(bad, 30), lambda: cad.young_interval(HOUR, bad),
                 lambda: cad.daly_interval(bad, 30), lambda: cad.steps_between(bad, 1),
                 lambda: cad.steps_between(10, bad), lambda: cad.job_mtbf(bad, 1)):
        with pytest.raises(ValueError, match="finite number > 0"):
            call()


def test_huge_finite_mtbf_does_not_overflow():
    assert math.isfinite(cad.young_interval(1e308, 1e3))
    assert math.isfinite(cad.daly_interval(1e308, 1e3))


def test_platform_table_has_every_platform_and_rejects_unknown():
    assert set(cad.NODE_MTBF_S) == {"aws", "gcp", "azure", "alibaba", "none"}
    assert set(cad.NODE_MTBF_S.values()) == {cad.DEFAULT_NODE_MTBF_S}  # one default, none included
    with pytest.raises(ValueError, match="unknown platform 'vast'"):
        cad.node_mtbf("vast")


def test_fixed_every_steps_counts_from_the_first_call():
    cadence = Cadence(every_steps=3)
    answers = [cadence.due(step) for step in range(100, 110)]
    assert [100 + i for i, a in enumerate(answers) if a] == [103, 106, 109]


def test_mark_saved_reanchors_the_count():
    cadence = Cadence(every_steps=5)
    cadence.due(0)
    cadence.mark_saved(3)
    assert [s for s in range(1, 12) if cadence.due(s)] == [8]


def test_every_seconds_turns_into_steps_by_measured_step_time():
    cadence = Cadence(every_seconds=10)
    assert cadence.due(0) is False
    assert not any(cadence.due(s) for s in range(1, 50)), "no step time yet: never due"
    cadence.observe_step(2.5)
    assert cadence.steps == 4
    # anchored at 0 and 50 steps have passed unsaved: due at once, then every 4
    assert [s for s in range(50, 60) if cadence.due(s)] == [50, 54, 58]


def test_adaptive_plan_uses_measured_cost_and_platform_mtbf():
    cadence = Cadence(platform="aws", nodes=2, formula="young", cost_s=1)
    cadence.observe_step(1.0)
    cadence.observe_save(10, 20)
    m = cad.NODE_MTBF_S["aws"] / 2
    assert cadence.cost_s == 30
    assert cadence.interval_s == pytest.approx(math.sqrt(2 * m * 30))
    assert cadence.steps == int(math.sqrt(2 * m * 30))


def test_cost_is_the_median_of_recent_saves_so_one_slow_save_does_not_replan():
    cadence = Cadence(mtbf_s=3 * HOUR, formula="young")
    cadence.observe_step(1.0)
    for blocking in (30, 30, 600, 30):
        cadence.observe_save(blocking, 0)
    assert cadence.cost_s == 30
    assert cadence.steps == 804
    for blocking in (120, 120, 120):  # the cost really changed: re-plan
        cadence.observe_save(blocking, 0)
    assert cadence.cost_s == 120
    assert cadence.steps == int(math.sqrt(2 * 3 * HOUR * 120))


def test_step_time_ewma_follows_a_change_and_replans():
    cadence = Cadence(every_seconds=100)
    cadence.observe_step(1.0)
    assert cadence.steps == 100
    for _ in range(60):
        cadence.observe_step(2.0)
    assert cadence.steps == 50


def test_cadence_rejects_bad_input():
    with pytest.raises(ValueError, match="not both"):
        Cadence(every_steps=10, every_seconds=10)
    with pytest.raises(ValueError, match="not both"):
        Cadence(mtbf_s=HOUR, platform="aws")
    for kwargs in ({"every_steps": 0}, {"every_seconds": 0}, {"mtbf_s": -1}, {"nodes": 0},
                   {"cost_s": float("nan")}, {"formula": "magic"}, {"platform": "vast"}):
        with pytest.raises(ValueError):
            Cadence(**kwargs)
    cadence = Cadence()
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError):
            cadence.observe_step(bad)
    for bad in ((-1, 0), (0, float("nan"))):
        with pytest.raises(ValueError):
            cadence.observe_save(*bad)


def test_an_unmeasured_save_is_ignored():
    cadence = Cadence(mtbf_s=HOUR, cost_s=30)
    cadence.observe_save(0, 0)
    assert cadence.cost_s == 30


def test_zero_step_time_plans_a_huge_but_finite_count():
    cadence = Cadence(mtbf_s=HOUR)
    cadence.observe_step(0.0)
    assert cadence.steps >= 10**9


def test_per_step_cost_is_small():
    cadence = Cadence(platform="gcp")
    n = 20000
    start = time.perf_counter()
    for step in range(n):
        cadence.observe_step(0.25)
        cadence.due(step)
    per_step = (time.perf_counter() - start) / n
    assert per_step < 50e-6, f"{per_step * 1e6:.1f} us per step"


def test_cadence_module_imports_without_torch():
    code = ("import sys, spotguard.cadence; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _run(*args: str):
    return CliRunner().invoke(cadence_command, list(args))


def test_cli_prints_the_computation_step_by_step():
    result = _run("--checkpoint-seconds", "30", "--mtbf-hours", "3", "--step-seconds", "1.5")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "sqrt(2 * 10800 * 30) = 805 s" in out
    assert "- C = 785 s" in out
    assert "Daly 523, Young 536" in out
    assert "10800 / 1" in out


def test_cli_divides_the_platform_default_by_nodes():
    result = _run("--checkpoint-seconds", "30", "--platform", "gcp", "--nodes", "8")
    assert result.exit_code == 0, result.output
    assert "21600 / 8 = 2700 s (45.0 min)" in result.output
    assert "--platform gcp: the default for one spot/preemptible node" in result.output


def test_cli_shows_the_one_default_mtbf_the_daemon_and_drill_assume():
    result = _run("--checkpoint-seconds", "30")
    assert result.exit_code == 0, result.output
    assert f"node MTBF          = 21600 s (6.0 h)  [{cad.DEFAULT_MTBF_SOURCE}, as the daemon and the drill " \
        "assume; --mtbf-hours H sets yours]" in result.output


def test_cli_warns_when_a_save_costs_more_than_twice_the_mtbf():
    result = _run("--checkpoint-seconds", "30", "--mtbf-hours", "0.001")
    assert result.exit_code == 0
    assert "C >= 2M, so T = M" in result.output and "warning:" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpoint-seconds", "0"], "--checkpoint-seconds must be a finite number > 0"),
        (["--checkpoint-seconds", "abc"], "--checkpoint-seconds must be a finite number > 0"),
        (["--checkpoint-seconds", "inf"], "--checkpoint-seconds must be a finite number > 0"),
        (["--checkpoint-seconds", "30", "--mtbf-hours", "-3"], "--mtbf-hours must be"),
        (["--checkpoint-seconds", "30", "--nodes", "2.5"], "--nodes must be an integer >= 1"),
        (["--checkpoint-seconds", "30", "--step-seconds", "nan"], "--step-seconds must be"),
        (["--checkpoint-seconds", "30", "--platform", "vast"], "--platform must be one of"),
        (["--checkpoint-seconds", "30", "--platform", "aws", "--mtbf-hours", "1"], "not both"),
    ],
)
def test_cli_invalid_input_exits_2_with_one_line(args, message):
    result = _run(*args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


def test_installed_spotguard_command_exits_2_with_one_line():
    exe = Path(sys.executable).with_name("spotguard")
    if not exe.exists():
        pytest.skip("the spotguard console script is not installed beside this interpreter")
    bad = subprocess.run([exe, "cadence", "--checkpoint-seconds", "-5"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "spotguard: --checkpoint-seconds must be a finite number > 0, got '-5'"]
    good = subprocess.run([exe, "cadence", "--checkpoint-seconds", "30", "--mtbf-hours", "3"],
                          capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and "= 805 s" in good.stdout
