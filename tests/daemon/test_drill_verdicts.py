"""``spotguard drill``'s verdicts on jobs written the way users write them: a PASS rests on
preemptions that took effect, a nondeterministic job is judged by what stays exact, and a broken
twin fails with the part it left out named, nondeterministic or not.

drill_job.py ``--noise`` adds 1e-7 relative gradient noise from a generator seeded from OS
entropy, as atomics-based GPU reductions do; ``--broken`` leaves one object out of ``Run``.
"""

from __future__ import annotations

import json
import re

import pytest

from test_drill_e2e import drill, job


def report_of(tmp_path) -> dict:
    return json.loads((tmp_path / "report" / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_job_shorter_than_a_save_is_inconclusive_never_passed(tmp_path):
    done = drill(tmp_path, "--no-reference", "-n", "2", job=job(
        "--steps", "8", "--save-every", "50", "--step-sleep", "0.01"))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "spotguard drill: INCONCLUSIVE" in done.stdout and "PASSED" not in done.stdout
    if "leave room for" in done.stdout:  # planned what fits (a loaded machine may end the job first)
        assert "leave room for 1 of the 2 preemptions asked" in done.stdout
    # 0 of 1 once the plan fitted the job; 0 of 2 when the job ended before any plan (a loaded machine)
    assert re.search(r"INCONCLUSIVE \(preemptions\): 0 of [12] preemption\(s\) took effect", done.stderr), done.stderr
    assert "Make the job run longer" in done.stderr
    assert re.search(r"the job sets its own cadence \(Run\(save_every=\.\.\.\) or cadence=\), which "
                     r"wins over the drill's \$SPOTGUARD_SAVE_EVERY: for the drill pass save_every=(?:[1-8]|N)\)",
                     done.stderr), done.stderr  # the argument, with a number that fits the 8 steps (N: no plan yet)
    report = report_of(tmp_path)
    assert report["verdict"] == "INCONCLUSIVE" and not report["passed"]
    assert report["effective_preemptions"] == 0 and len(report["launches"]) == 1


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_nondeterministic_job_passes_on_what_stays_exact(tmp_path):
    done = drill(tmp_path, "-n", "2", "--seed", "2", "--json", job=job(
        "--noise", "--steps", "120", "--step-sleep", "0.02"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not reproducible run to run" in done.stdout
    assert "torch.use_deterministic_algorithms(True)" in done.stdout
    report = json.loads(done.stdout.splitlines()[-1])  # --json: the report on the last line
    assert report == report_of(tmp_path)
    assert report["effective_preemptions"] == 2 and all(row["effective"] for row in report["preemptions"])
    spread = report["spread"]
    assert 0 < spread["reference"] and spread["drill"] <= spread["threshold"]
    assert spread["loss"]["drill"] <= spread["loss"]["threshold"]  # the final loss too, threshold shown
    assert "the final loss lies" in done.stdout and "threshold" in done.stdout
    assert {check["name"] for check in report["checks"]} >= {
        "data", "loads", "identical", "rng streams", "step", "epoch", "lr"}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("broken, named, also", [
    ("no-optimizer", "not in its checkpoint: optimizer (AdamW) training model: 0.weight", "lr"),
    ("no-scheduler", "not in its checkpoint: LR scheduler", None),  # LR equal again after warm-up
    ("global-rng-loader", "the data position and its seeds are not recorded", "rng streams"),
    ("no-loader", "the data position and its seeds are not recorded", None)])
@pytest.mark.parametrize("noise", [True, False], ids=["nondeterministic", "deterministic"])
def test_a_broken_twin_fails_with_the_part_it_left_out_named(tmp_path, broken, named, also, noise):
    """Each part left out fails the drill, deterministic or not: by the final digests or the
    references' spread, with the cause named from the record, and by the marks that stay exact
    even for a nondeterministic job (the LR after a resume, the RNG streams)."""
    done = drill(tmp_path, "-n", "1", "--seed", "1", job=job(
        "--broken", broken, *(["--noise"] if noise else []), "--steps", "100", "--step-sleep", "0.02"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED (identical)" in done.stderr and named in done.stderr
    assert ("not reproducible run to run" in done.stderr) == noise
    report = report_of(tmp_path)
    assert report["effective_preemptions"] == 1
    if also:
        assert f"FAILED ({also}): " in done.stderr
