"""A notice on one node stops every rank of a two-node job at one step; the relaunch resumes exactly.

Two network namespaces stand for two nodes (see conftest.py), each with its own daemon and its own
torchrun agent. ``spotguard notify`` goes to node b's daemon only: node b's ranks hold the notice,
node a's ranks learn of it only through the ranks' agreement, and all of them must save the same
step and exit 75. The identical commands relaunched on both nodes then resume from that step and
end bit-identical to an uninterrupted two-node run (equal ``finish`` digests in the run record).
"""

from __future__ import annotations

import re

import pytest

from spotguard.checkpoint import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # torchrun start-up on a loaded CI

STEPS, NPROC = 80, 2
ARGS = ("--steps", str(STEPS), "--save-every", "60")
PACED = (*ARGS, "--step-sleep", "0.25")  # the pace only changes where the notice lands


@pytest.fixture(scope="module")
def stopped(cluster):
    """The job stopped by a notice on node b a few steps in (before its first periodic save)."""
    job = cluster.launch("stopped", "job", *PACED, nproc=NPROC)
    job.wait_for("progress", 1, lambda e: e["step"] >= 3)
    cluster.nodes[1].notify(deadline=60)
    codes = job.wait(120)
    return job, codes


def test_a_notice_on_one_node_stops_every_rank_of_both_nodes_at_one_step(cluster, stopped):
    job, codes = stopped
    assert codes == [1, 1], job.output()  # torchrun reports its workers' 75 as a failure
    exits = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", job.output(), re.MULTILINE)
    assert exits == ["75"] * 2 * NPROC, job.output()  # every rank of both nodes really exited 75

    stops = {e["rank"]: e for e in job.events("stop")}
    assert sorted(stops) == list(range(2 * NPROC)), job.output()
    steps = {e["step"] for e in stops.values()}
    assert len(steps) == 1, stops  # one step on every rank of both nodes
    step = steps.pop()
    assert 3 <= step < 60
    by_node = {rank: rank // NPROC for rank in stops}  # torchrun numbers node a's ranks first
    for rank, event in stops.items():
        held = event["notice"]
        if by_node[rank] == 1:
            assert held and held["kind"] == "drill", event  # node b's daemon told its ranks
        else:
            assert held is None, event  # node a's learned it from the agreement alone
    assert all(e["saved"] for e in stops.values())

    commits = {(e["step"], e["kind"]) for e in job.events("commit")}
    assert commits == {(step, "emergency")}  # every rank recorded the same one commit
    latest = Checkpointer(cluster.checkpoint_root / "job").latest()
    assert latest.step == step  # the one checkpoint every rank wrote a part of, committed


@pytest.fixture(scope="module")
def relaunched(cluster, stopped):
    """The identical command relaunched on both nodes, and an uninterrupted reference run beside it
    (its own checkpoint directory and job id, so it cannot restore the stopped run's checkpoint)."""
    resumed = cluster.launch("resumed", "job", *ARGS, nproc=NPROC)
    reference = cluster.launch("reference", "reference", *ARGS, nproc=NPROC)
    assert resumed.wait(180) == [0, 0], resumed.output()
    assert reference.wait(180) == [0, 0], reference.output()
    return resumed, reference


def test_the_relaunch_on_both_nodes_resumes_from_the_stop_step(cluster, stopped, relaunched):
    step = stopped[0].events("stop")[0]["step"]
    resumed, reference = relaunched
    starts = resumed.events("start")
    on_disk = sorted(p.name for p in (cluster.checkpoint_root / "job").iterdir())
    assert len(starts) == 2 * NPROC and {s["resumed_from"] for s in starts} == {step}, \
        (starts, on_disk, stopped[1], stopped[0].events("stop"), stopped[0].events("commit"), resumed.output())
    assert {s["resumed_from"] for s in reference.events("start")} == {None}  # really uninterrupted
    assert len({e["digest"] for e in resumed.events("finish")}) == 1  # every rank ends in one state


def test_the_relaunch_ends_identical_to_an_uninterrupted_two_node_run(relaunched):
    """Four DDP ranks: exact only because the resumed DDP gets its rebuilt gradient buckets before its
    first step (spotguard._ddp); without that the last bits differ from the first resumed step on."""
    resumed, reference = relaunched
    finished = {e["digest"] for e in resumed.events("finish")}
    expected = {e["digest"] for e in reference.events("finish")}
    assert len(expected) == 1 and finished == expected
