"""Node-local checkpoint roots on two nodes (issue 24 items 1-2): a notice, the store, a fresh node.

Two network namespaces, a daemon and a torchrun agent (2 ranks) each; each node's checkpoint root
is its own directory (``local-a``, ``local-b``: separate directories on this machine's disk, not
tmpfs), and the durable store is a ``file://`` bucket both daemons reach (the S3 emulator listens
on the host's loopback, which the namespaces cannot reach). A notice on node b stops every rank of
both nodes at one step; each node commits its own ranks' parts, each daemon uploads its node's
part, and the step becomes globally committed once both are in the store. The relaunch on node a
and a fresh node c (node b's namespace with an empty root) resumes from that step and ends
bit-identical to an uninterrupted run with the same roots layout.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from _twonodes import netns_available, two_nodes
from spotguard.storage import Durable, open_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, NPROC = 30, 2
ARGS = ("--steps", str(STEPS), "--save-every", "20")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = netns_available()
    if why:
        pytest.skip(f"MULTI-NODE TESTS SKIPPED: {why}")
    work = tmp_path_factory.mktemp("multinode-local")
    with two_nodes(work, store=f"file://{work}/bucket", node_local=True) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def runs(cluster):
    work = cluster.workdir
    roots = [work / "local-a", work / "local-b"]
    reference = cluster.launch("reference", "ref", *ARGS, nproc=NPROC, roots=roots)
    stopped = cluster.launch("stopped", "job", *ARGS, "--step-sleep", "0.25", nproc=NPROC, roots=roots)
    stopped.wait_for("progress", 1, lambda e: e["step"] >= 3)
    cluster.nodes[1].notify(deadline=60)
    stopped_codes = stopped.wait(180)
    assert reference.wait(300) == [0, 0], reference.output()
    durable = Durable(open_store(f"file://{work}/bucket"))
    deadline = time.monotonic() + 120  # under load, each daemon may still be uploading the reference's
    while not durable.list("multinode-job") and time.monotonic() < deadline:
        time.sleep(0.2)  # both daemons upload their node's part; the second completes the set
    global_steps = durable.list("multinode-job")
    logs = "\n".join(node.daemon_log()[-3000:] for node in cluster.nodes)
    fresh = work / "local-b" / "fresh"  # node c: node b's namespace, an empty root under its daemon's
    fresh.mkdir()
    resumed = cluster.launch("resumed", "job", *ARGS, nproc=NPROC, roots=[roots[0], fresh])
    resumed_codes = resumed.wait(300)
    return {"reference": reference, "stopped": stopped, "stopped_codes": stopped_codes,
            "global": global_steps, "logs": logs, "resumed": resumed, "resumed_codes": resumed_codes, "fresh": fresh}


def test_a_notice_stops_every_rank_and_the_step_is_globally_committed_once_both_parts_are_durable(runs):
    stopped = runs["stopped"]
    assert runs["stopped_codes"] == [1, 1], stopped.output()
    exits = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", stopped.output(), re.MULTILINE)
    assert exits == ["75"] * 2 * NPROC, stopped.output()
    steps = {e["step"] for e in stopped.events("stop")}
    assert len(steps) == 1 and len(stopped.events("stop")) == 2 * NPROC, stopped.events("stop")
    step = steps.pop()
    assert runs["global"] == [step], runs["logs"]  # one global manifest, of the stop's step


def test_the_relaunch_on_node_a_and_a_fresh_node_ends_bit_identical(runs):
    resumed, reference = runs["resumed"], runs["reference"]
    assert runs["resumed_codes"] == [0, 0], resumed.output()
    (start,) = {e["resumed_from"] for e in resumed.events("start")}
    assert [start] == runs["global"], runs["logs"]
    (fetched,) = (runs["fresh"] / "job").glob(f"step-{start:010d}")
    manifest = json.loads((fetched / "manifest.json").read_text())
    assert manifest["node"] == {"leader": 0, "ranks": [0, 2, 3], "restored": True}  # not rank 1's part
    assert {rel.split("/")[0] for rel in manifest["files"]} == {"rank-0", "rank-2", "rank-3"}
    final = {e["digest"] for e in resumed.events("finish")}
    assert len(final) == 1 and final == {e["digest"] for e in reference.events("finish")}, resumed.output()


def test_each_node_commits_only_its_own_ranks_parts(cluster, runs):
    for letter, ranks in (("a", [0, 1]), ("b", [2, 3])):
        step = cluster.workdir / f"local-{letter}" / "ref" / f"step-{STEPS:010d}"
        manifest = json.loads((step / "manifest.json").read_text())
        node = manifest["node"]
        assert (node["nodes"], node["leader"], node["ranks"], len(node["digests"])) == (2, ranks[0], ranks, 4)
        assert {rel.split("/")[0] for rel in manifest["files"]} == {f"rank-{r}" for r in ranks}
        tree = json.loads((step / f"rank-{ranks[0]}" / "tree.json").read_text())
        assert {"model", "optimizer"} <= {name for name, *_ in tree["entries"]}  # the leader's replicated state
