"""``spotguard drill --resize``: a torchrun job relaunched on another number of ranks, judged by what
an elastic resume promises (the state loaded, the sample sequence, the loss curve), never by
bit-identity.

End to end (real torchrun, gloo, CPU, the README's DDP loop in ``drill_ddp_job.py``): 2 ranks preempted
by a notice mid-epoch and relaunched on 3 pass; the twin (10 steps an epoch) that restarts its data at epoch 0 fails, naming the epoch it left
and the one it started over. On records written by real ``ResumableSampler``s (2 ranks, a step lost
to a kill, 3 ranks resumed from rank 0's state, padding at the epoch's end): the samples check
passes, and fails for a relaunch that restarts its position or keeps it without re-splitting. A
rank that loaded the weights but not the optimizer (digests of real ones), and a loss that jumps
after the resume, fail by name.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard import ResumableSampler
from spotguard._record import Recorder, read
from spotguard_daemon.commands.drill_checks import Launch
from spotguard_daemon.commands.drill_resize import nproc, resize_checks, with_nproc
from test_drill_e2e import DRILL, drill

HERE = Path(__file__).parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
N = 30  # samples: 15 a rank on 2 ranks; the rest re-split over 3 ends in padding


def job(*extra: str) -> list[str]:
    return [TORCHRUN, "--nproc-per-node", "2", str(HERE / "drill_ddp_job.py"), "--ckpt-dir", "ckpt",
            "--samples", "40", "--batch", "2", "--steps", "48", "--save-every", "8", "--step-sleep", "0.1", *extra]


def report_of(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "report" / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_ddp_job_resized_from_2_to_3_ranks_passes_on_what_is_promised(tmp_path):
    # 200 samples: one epoch spans the whole job, so that wherever the load puts the preemption,
    # the relaunch goes on mid-epoch and the re-split is exercised (at 40, 10 steps an epoch, a
    # stop at a multiple of 10 left nothing to re-split, and the drill was rightly inconclusive)
    done = drill(tmp_path, "-n", "1", "--seed", "9", "--resize", "3", job=job("--samples", "200"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = report_of(tmp_path)
    assert report["verdict"] == "PASSED" and report["effective_preemptions"] == 1
    assert [launch["ranks"] for launch in report["launches"]] == [2, 3]
    assert report["launches"][-1]["resumed_from"] > 0 and report["reference"] is None
    assert "not bit-identical across world sizes" in report["resize"] and "resize:" in done.stdout
    checks = {check["name"]: check for check in report["checks"]}
    assert all(check["ok"] for check in checks.values())
    assert {"loaded state", "samples", "loss"} <= checks.keys() and "identical" not in checks
    assert "launch 2 (3 ranks): ranks 0, 1, 2 loaded step" in checks["loaded state"]["detail"]
    assert "drawn once each by launch 1 (2 ranks), launch 2 (3 ranks)" in checks["samples"]["detail"]
    assert "re-derived for the new ranks" in checks["rng streams"]["detail"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resized_job_that_restarts_its_data_fails_naming_where_it_started_over(tmp_path):
    done = drill(tmp_path, "-n", "1", "--seed", "9", "--resize", "3", job=job("--own-epoch-counter"))
    assert done.returncode == 1, done.stdout + done.stderr
    # which epoch the stop came in depends on the machine's load: the message names it, whichever
    left = re.search(r"spotguard drill: FAILED \(samples\): epoch 0 \(pass (\d)\) was drawn by launch 2 "
                     r"\(3 ranks\) after epoch (\d) \(pass (\d)\)", done.stderr)
    assert left and int(left[1]) == int(left[3]) + 1 and int(left[2]) == int(left[3]) - 1 >= 1, done.stderr
    assert "the data started over" in done.stderr  # "samples never drawn: ..." when an epoch was left unfinished
    failed = {check["name"] for check in report_of(tmp_path)["checks"] if not check["ok"]}
    assert "samples" in failed and not failed & {"loaded state", "loss"}  # the state and the loss went on


def test_resize_needs_a_torchrun_command_with_another_number_of_ranks(tmp_path):
    assert with_nproc(["torchrun", "--nproc_per_node=2", "a.py", "--nproc-per-node", "9"], 3) == [
        "torchrun", "--nproc_per_node=3", "a.py", "--nproc-per-node", "9"]
    assert nproc(["torchrun", "--standalone", "--nproc-per-node", "4", "a.py"]) == 4
    for command, error in ((["python", "train.py"], "names no --nproc-per-node"),
                           (job(), "already runs 2 ranks")):
        size = "2" if command == job() else "3"
        done = subprocess.run([*DRILL, "--resize", size, "--report-dir", str(tmp_path / "r"), "--", *command],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and error in done.stderr, done.stderr
        assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def _launch(tmp_path: Path, index: int, samplers: list, steps: range, resumed: int | None,
            save_at: int | None = None) -> tuple[Launch, dict | None]:
    """A launch of ``len(samplers)`` ranks drawing up to 2 samples a rank a step over ``steps``, its
    samples (and rank 0's loss) recorded per step by a real Recorder, as the library does; and rank
    0's sampler state after step ``save_at``."""
    path, saved = tmp_path / f"{index}.jsonl", None
    recorders = [Recorder(path, rank=r) for r in range(len(samplers))]
    recorders[0].start(root=tmp_path, world_size=len(samplers), resumed_from=resumed, skipped=[],
                       total=100, entries=["loader"])
    iterators = [iter(sampler) for sampler in samplers]
    for step in steps:
        for rank, (sampler, it) in enumerate(zip(samplers, iterators)):
            take = min(2, sampler.num_samples - sampler.position)
            for _ in range(take):
                next(it)
            sampler.advance(take)
            recorders[rank].emit("samples", step=step, of=N, loss=1.0 if rank == 0 else None,
                                 drawn=[list(chunk) for chunk in sampler.take_consumed()])
        if step == save_at:
            saved = samplers[0].state_dict()
    return Launch(index, events=list(read(path))), saved


def _samplers(world: int, state: dict | None = None) -> list:
    samplers = [ResumableSampler(N, seed=3, rank=r, world_size=world) for r in range(world)]
    for sampler in samplers:
        sampler.consumed = []
        if state is not None:
            sampler.load_state_dict(state)
    return samplers


@pytest.mark.parametrize("broken", [None, "restarted", "not re-split"])
def test_the_samples_check_follows_places_across_a_resize_and_a_lost_step(tmp_path, broken):
    first, saved = _launch(tmp_path, 1, _samplers(2), range(1, 6), None, save_at=4)  # step 5 lost to a kill
    if broken == "restarted":
        saved = dict(saved, position=0, base=0, world_size=3)
    if broken == "not re-split":  # each rank keeps its position 8, over a 3-rank split of the whole epoch
        saved = dict(saved, world_size=3)
    second, _ = _launch(tmp_path, 2, _samplers(3, saved), range(5, 8), 4)  # (30 - 16) / 3: 5 a rank + padding
    check = next(c for c in resize_checks([first, second]) if c.name == "samples")
    if broken == "restarted":
        assert not check.ok and "place(s) of its order drawn twice" in check.detail
        assert "by launch 1 (2 ranks) at step 1 and by launch 2 (3 ranks) at step 5" in check.detail
    elif broken:
        assert not check.ok and "epoch 0 (pass 1): 8 place(s) from place 16 of its order were never drawn" \
            in check.detail, check.detail
    else:
        assert check.ok, check.detail
        assert "epoch 0 (pass 1): places 0-30 drawn once each by launch 1 (2 ranks), launch 2 (3 ranks)" \
            in check.detail


def test_a_rank_that_did_not_load_the_optimizer_and_a_loss_that_jumps_fail_by_name(tmp_path):
    """Digests of real modules and optimizers (``state_digests``), recorded as the library records
    its marks: rank 2 of the relaunch holds the saved weights but a fresh optimizer; the loss after
    the resume jumps from about 0.1 to 2."""
    import torch

    from spotguard._audit import state_digests

    def trained(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 3)).square().sum().backward()
        opt.step()
        return model, opt

    model, opt = trained(0)
    saved = state_digests({"model": model, "optimizer": opt})
    fresh_model, fresh_opt = trained(1)
    fresh_model.load_state_dict(model.state_dict())  # the weights, not the optimizer
    partial = state_digests({"model": fresh_model, "optimizer": fresh_opt})
    assert partial["model"] == saved["model"] and partial["optimizer"] != saved["optimizer"]

    first_rec = Recorder(tmp_path / "1.jsonl")
    first_rec.start(root=tmp_path, world_size=2, resumed_from=None, skipped=[], total=40, entries=["model"])
    for step in range(1, 21):
        first_rec.emit("samples", step=step, loss=0.1 + 0.01 * (step % 3))
    first_rec.emit("marks", step=20, at="save", state=saved)
    recs = [Recorder(tmp_path / "2.jsonl", rank=r) for r in range(3)]
    recs[0].start(root=tmp_path, world_size=3, resumed_from=20, skipped=[], total=40, entries=["model"])
    for rank, rec in enumerate(recs):
        rec.emit("marks", step=20, at="load", state=partial if rank == 2 else saved)
    for step in range(21, 31):
        recs[0].emit("samples", step=step, loss=2.0)
    launches = [Launch(i, events=list(read(tmp_path / f"{i}.jsonl"))) for i in (1, 2)]
    checks = {check.name: check for check in resize_checks(launches)}
    assert not checks["loaded state"].ok and not checks["loaded state"].inconclusive
    assert checks["loaded state"].detail.startswith(
        "launch 2 (3 ranks): rank 2's optimizer right after loading step 20 is not the one launch 1 "
        "(2 ranks) saved at that step")
    assert not checks["loss"].ok and "mean loss 2 over its first 10 steps" in checks["loss"].detail
    assert "the loss curve does not continue" in checks["loss"].detail
