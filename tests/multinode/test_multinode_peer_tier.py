"""The peer tier on two network namespaces: a node lost without notice costs one local save interval.

Two nodes with node-local roots (a tmpfs each), no bucket at all (``storage.url = none``), and the
peer tier in a ring: each daemon serves partners' parts on its node's address and copies its own
node's committed parts to the other. Node b is SIGKILLed whole (daemon included, link down, no
notice) after its step 20 reached node a. Without the tier nothing could bring node b's part back.
With it, the relaunch on node a and a fresh node c (node b's namespace, an empty root, a new
daemon) agrees on step 20, node c restores its ranks' part from node a's daemon, verified, and the
job ends bit-identical to an uninterrupted run. The record says where each rank's step came from.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from _twonodes import netns_available, peer_ring, two_nodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, NPROC, SAVE, PORT = 40, 2, 10, 9475
SECRET = "the-ring-secret-of-this-test-job"
ARGS = ("--steps", str(STEPS), "--save-every", str(SAVE), "--keep", "2", "--width", "65536")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = netns_available()
    if why:
        pytest.skip(f"MULTI-NODE TESTS SKIPPED: {why}")
    with two_nodes(tmp_path_factory.mktemp("multinode-peer"), store="none", node_local=True,
                   env=peer_ring(PORT, SECRET)) as cluster:
        yield cluster


def test_a_node_lost_without_notice_resumes_from_its_partners_copy_bit_identical(cluster):
    a, b = cluster.nodes
    roots = [cluster.workdir / "local-a", cluster.workdir / "local-b"]
    reference = cluster.launch("reference", "ref", *ARGS, nproc=NPROC, roots=roots)
    assert reference.wait(300) == [0, 0], reference.output()

    lost = cluster.launch("lost", "lost", *ARGS, "--step-sleep", "0.25", "--peer-timeout", "5",
                          nproc=NPROC, roots=roots)
    slot = a.state_dir / "peer" / "multinode-lost" / "ranks-2-3"
    deadline = time.monotonic() + 180
    while not (slot / f"step-{2 * SAVE:010d}" / "manifest.json").exists():
        assert time.monotonic() < deadline, f"node b's step 20 never reached node a:\n{b.daemon_log()[-3000:]}"
        assert all(launch.proc.poll() is None for launch in lost.launches), lost.output()
        time.sleep(0.05)
    b.link_down()
    assert b.daemon.pid in b.kill_all()
    held = sorted(int(p.name[5:]) for p in slot.glob("step-*"))  # 20, and 30 on a slow machine
    codes = lost.wait(120)
    assert codes[0] == 1, lost.output()  # node a's ranks gave up on the lost peers
    assert re.search(rf"peer: holds step {2 * SAVE} of job 'multinode-lost', ranks-2-3 \(\d+ files",
                     a.daemon_log()), a.daemon_log()[-3000:]
    assert re.search(r"peer: step 10 of job 'multinode-lost' \(ranks-2-3, \d+ bytes\) copied to "
                     rf"http://{a.addr}:{PORT}", b.daemon_log()), b.daemon_log()[-3000:]

    b.link_up()
    fresh = cluster.tmpfs(cluster.workdir / "local-c")
    b.start_fresh_daemon(fresh)
    resumed = cluster.launch("lost-resumed", "lost", *ARGS, nproc=NPROC, roots=[roots[0], fresh])
    assert resumed.wait(300) == [0, 0], resumed.output()
    starts = resumed.events("start")
    assert {e["resumed_from"] for e in starts} == {held[-1]}, (held, resumed.output())
    assert sorted(e["tier"] for e in starts) == ["local", "local", "peer", "peer"], starts
    assert "restored from the peer" in resumed.output()
    newest = json.loads((fresh / "lost" / f"step-{STEPS:010d}" / "manifest.json").read_text())
    assert newest["node"]["ranks"] == [2, 3]  # node c ran node b's ranks
    final = {e["digest"] for e in resumed.events("finish")}
    assert len(final) == 1 and final == {e["digest"] for e in reference.events("finish")}, resumed.output()
