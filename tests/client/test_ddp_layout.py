"""Three-rank DDP resumes bit-identically because the checkpoint records the bucket layout DDP built.

Each test runs ``_ddp_layout_job.py`` under real ``torchrun`` (3 ranks, gloo, CPU): once
uninterrupted, then stopped by a SIGTERM to rank 0 mid-run (every rank saves at the agreed step and
exits 75) and relaunched; the final weights and optimizer state must be bit-identical. The jobs'
backward readies gradients out of parameter order (bf16 autocast; a tied weight and blocks applied
in reverse), where the old reversed-order guess is wrong: the residual case also resumes through
that guess (``$JOB_GUESS=1``) and shows it diverging. Each job's uninterrupted run is shared by the
tests of this module. The residual autocast case runs every time; of the other Run cases and of
the two frameworks one each is sampled per run (``_matrix.py``: the seed is printed,
``SPOTGUARD_MATRIX_ALL=1`` runs all), to keep the suite's time in check.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _example import isolated_env
from _matrix import SEED, sample, skip_reason

JOB = Path(__file__).with_name("_ddp_layout_job.py")
RANKS, STEPS = 3, 14  # _ddp_layout_job.STEPS
RUN_CASES = ["residual-autocast-first-step", "shared-weights-accumulate", "residual-static-graph"]
CHOSEN = {"residual-autocast"} | sample("ddp-layout-run", RUN_CASES, 1) | sample("ddp-layout-frameworks",
                                                                                  ["hf", "lightning"], 1)


def sampled(case: str) -> None:
    if case not in CHOSEN:
        pytest.skip(skip_reason())
    print(f"SPOTGUARD_MATRIX_SEED={SEED}")


def launch(kind: str, out: Path, **knobs: str) -> tuple[int, str]:
    env = isolated_env(out.with_name(out.name + ".rt"), **knobs)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
            str(JOB), kind, str(out)]
    done = subprocess.run(argv, env=env, timeout=300, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    return done.returncode, done.stdout


def finished(kind: str, out: Path, **knobs: str) -> str:
    code, output = launch(kind, out, **knobs)
    assert code == 0, output[-6000:]
    return output


def stopped(kind: str, out: Path, stop: int, **knobs: str) -> int:
    """Launch with rank 0 SIGTERMed in step ``stop``; every rank exits 75; the step saved at."""
    code, output = launch(kind, out, JOB_STOP=str(stop), **knobs)
    assert code != 0 and "stopping at step" in output, output[-6000:]
    assert re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", output, re.M) == ["75"] * RANKS, output[-6000:]
    return int(re.findall(r"stopping at step (\d+)", output)[-1])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run's output for (kind, knobs), run once per module."""
    outputs: dict[tuple, str] = {}

    def get(kind: str, **knobs: str) -> str:
        key = (kind, *sorted(knobs.items()))
        if key not in outputs:
            outputs[key] = finished(kind, tmp_path_factory.mktemp("reference") / "out", **knobs)
        return outputs[key]

    return get


def line(output: str, key: str) -> str:
    return re.findall(rf"^{key} (.+)$", output, re.M)[-1]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, knobs, stop", [
    ("residual", {}, 5),
    ("residual", {}, 0),  # saved after step 1: DDP's rebuild is due, not done
    ("shared", {}, 5),
    ("residual", {"JOB_STATIC": "1"}, 5),
], ids=["residual-autocast", "residual-autocast-first-step", "shared-weights-accumulate", "residual-static-graph"])
def test_run_resumes_three_rank_ddp_bit_identically(tmp_path, uninterrupted, kind, knobs, stop, request):
    sampled(request.node.callspec.id)
    reference = uninterrupted(kind, **knobs)
    layout = json.loads(line(reference, "LAYOUT"))
    record = layout["ddps"]["model"]
    assert layout["restorable"] and record["rebuilt"] and layout["world_size"] == RANKS
    assert record["buckets"] != json.loads(line(reference, "GUESS")), "the guess was right: proves nothing"

    saved = stopped(kind, tmp_path / "stopped", stop=stop, **knobs)
    assert saved == 1 if stop == 0 else saved > stop
    if kind == "residual" and not knobs and stop:
        shutil.copytree(tmp_path / "stopped", tmp_path / "guessed")
        guessed = finished(kind, tmp_path / "guessed", JOB_GUESS="1")
        assert line(guessed, "DIGEST") != line(reference, "DIGEST"), "the old guess resumed exactly"
    resumed = finished(kind, tmp_path / "stopped", **knobs)
    assert 0 < int(line(resumed, "START")) < STEPS
    assert line(resumed, "DIGEST") == line(reference, "DIGEST")
    assert json.loads(line(resumed, "LAYOUT")) == layout


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["hf", "lightning"])
def test_framework_three_rank_ddp_resumes_bit_identically(tmp_path, uninterrupted, kind):
    """HF Trainer with ddp_find_unused_parameters=False, Lightning's strategy="ddp"; bf16 autocast."""
    sampled(kind)
    reference = line(uninterrupted(kind), "DIGEST")
    stopped(kind, tmp_path / "stopped", stop=5)
    resumed = finished(kind, tmp_path / "stopped")
    assert 0 < int(line(resumed, "START")) < STEPS
    assert line(resumed, "DIGEST") == reference
