"""The peer tier on three nodes x 2 ranks with a bucket: one node lost, then two at once.

Three network namespaces on a bridge (``_twonodes.py``), node-local roots (a tmpfs each), the S3
emulator as the bucket, and the peer tier in a ring with K = 1: node a copies its part to b, b to
c, c to a. One reference run, then one job through two losses without notice, each followed by the
identical command on the survivors plus fresh nodes:

1. Node c is SIGKILLed whole (link down first, daemon included) once its step 20 reached node a.
   The relaunch on a, b and a fresh c resumes from the newest step node a holds of c's ranks:
   nodes a and b load their own, node c's ranks load the copy node a held (``peer``).
2. Mid-way through that run, once a step newer than the resume is global in the bucket, nodes b
   and c are lost at once. Node b's only copy was on node c: nothing off-node but the bucket holds
   it, so the relaunch on a and two fresh nodes falls back to the newest global step, and node b
   says so in one line before it fetches its part from the bucket.

Both resumes end bit-identical to the uninterrupted run, and the record names each rank's tier.
"""

from __future__ import annotations

import re
import time

import pytest
from _bucket import Bucket
from _twonodes import netns_available, peer_ring, two_nodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, NPROC, SAVE, PORT, NODES = 60, 2, 10, 9476, 3
SECRET = "the-three-node-ring-secret-of-this-test"
JOB = "multinode-lost3"
ARGS = ("--steps", str(STEPS), "--save-every", str(SAVE), "--keep", "2", "--width", "65536")
SLOW = ("--step-sleep", "0.3", "--peer-timeout", "5")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = netns_available()
    if why:
        pytest.skip(f"MULTI-NODE TESTS SKIPPED: {why}")
    work = tmp_path_factory.mktemp("multinode-peer3")
    bucket = Bucket(work)
    try:
        with two_nodes(work, bucket=bucket, node_local=True, env=peer_ring(PORT, SECRET), count=NODES) as cluster:
            cluster.bucket = bucket
            yield cluster
    finally:
        bucket.close()


def lose(*nodes) -> None:
    """Nodes gone with no notice: off the network first, then every process SIGKILLed."""
    for node in nodes:
        node.link_down()
    for node in nodes:
        assert node.daemon.pid in node.kill_all()


def replace(cluster, roots, *nodes) -> None:
    """A fresh node in each lost node's namespace: link up, an empty tmpfs root (set in ``roots``),
    a new daemon."""
    for node in nodes:
        node.link_up()
        roots[node.index] = cluster.tmpfs(cluster.workdir / f"local-{node.name}-{time.monotonic_ns()}")
        node.start_fresh_daemon(roots[node.index])


def test_one_node_lost_resumes_from_its_partner_and_two_lost_fall_back_to_the_bucket(cluster):
    a, b, c = cluster.nodes
    roots = [cluster.workdir / f"local-{x}" for x in "abc"]
    reference = cluster.launch("reference", "ref", *ARGS, nproc=NPROC, roots=roots)
    assert reference.wait(300) == [0] * NODES, reference.output()
    digest = {e["digest"] for e in reference.events("finish")}

    # 1. Node c lost once node a holds its step 20.
    lost = cluster.launch("lost", "lost3", *ARGS, *SLOW, nproc=NPROC, roots=roots)
    held_by_a = a.state_dir / "peer" / JOB / "ranks-4-5"
    deadline = time.monotonic() + 240
    while not (held_by_a / f"step-{2 * SAVE:010d}" / "manifest.json").exists():
        assert time.monotonic() < deadline, f"node c's step 20 never reached node a:\n{c.daemon_log()[-3000:]}"
        assert all(launch.proc.poll() is None for launch in lost.launches), lost.output()
        time.sleep(0.05)
    lose(c)
    held = sorted(int(p.name[5:]) for p in held_by_a.glob("step-*"))
    assert lost.wait(120)[:2] == [1, 1], lost.output()  # a's and b's ranks gave up on the lost peers
    replace(cluster, roots, c)
    resumed = cluster.launch("resumed", "lost3", *ARGS, *SLOW, nproc=NPROC, roots=roots)
    starts = resumed.wait_for("start", NODES * NPROC, timeout=240)
    assert {e["resumed_from"] for e in starts} == {held[-1]}, (held, resumed.output())
    assert sorted(e["tier"] for e in starts) == ["local"] * 4 + ["peer"] * 2, starts
    assert "restored from the peer" in resumed.launches[2].output()

    # 2. Nodes b and c lost at once, once a step past the resume is global in the bucket.
    durable = cluster.bucket.durable()
    deadline = time.monotonic() + 240
    while not [s for s in durable.list(JOB) if s > held[-1]]:
        assert time.monotonic() < deadline, "no step past the resume became global:\n" + "\n".join(
            n.daemon_log()[-2000:] for n in cluster.nodes)
        assert all(launch.proc.poll() is None for launch in resumed.launches), resumed.output()
        time.sleep(0.1)
    lose(b, c)
    time.sleep(1.0)  # node a's own upload may still land; without b's and c's parts nothing new is global
    global_steps = durable.list(JOB)
    assert resumed.wait(120)[0] == 1, resumed.output()
    replace(cluster, roots, b, c)
    final = cluster.launch("final", "lost3", *ARGS, nproc=NPROC, roots=roots)
    assert final.wait(300) == [0] * NODES, final.output()
    starts = final.events("start")
    assert {e["resumed_from"] for e in starts} == {max(global_steps)}, (global_steps, final.output())
    tiers = {e["rank"]: e["tier"] for e in starts}
    assert tiers[2] == tiers[3] == "bucket", starts
    said = re.findall(r"no partner \(http://[\d.]+:\d+\) holds step \d+ of ranks-2-3; fetching it from the store",
                      final.launches[1].output())
    assert len(said) == 1, final.launches[1].output()
    assert {e["digest"] for e in final.events("finish")} == digest, final.output()
