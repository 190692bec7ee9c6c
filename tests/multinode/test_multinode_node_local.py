"""Node-local checkpoint roots on two nodes (issue 24 items 1-2): a notice, the store, a fresh node.

Two network namespaces, a daemon and a torchrun agent (2 ranks) each; each node's checkpoint root
is a tmpfs of its own (``local-a``, ``local-b``), and the durable store is the S3 emulator, which
both nodes reach through relays in node a's namespace (``_bucket.py``). A notice on node b stops
every rank of both nodes at one step; each node commits its own ranks' parts, each daemon uploads
its node's part, and the step becomes globally committed once both are in the store. The relaunch
on node a and a fresh node c (node b's namespace with an empty root) resumes from that step and
ends bit-identical to an uninterrupted run with the same roots layout.

Last, node b is killed with no notice in the middle of its upload: its relay holds the first object
of the upload after its part of step 10 (``HoldingRelay``: the pending note of step 20 is written,
none of its objects lands). Once node a's part of step 20 is in the store, node b drops off the
network and every process in its namespace, daemon included, is SIGKILLed. The store never shows
step 20 as globally committed, node a's ranks exit 77, and the relaunch on node a and a fresh node c
(a new daemon in b's namespace on a new, empty tmpfs) resumes from step 10, bit-identical. Node a
keeps one local checkpoint, so it holds only step 20 then (issue 28 item 1: every rank used to
refuse to start): the ranks agree on step 10, which node a fetches from the store too, and node a's
step 20, of the abandoned run, is set aside.

Before that, the `run` script of deploy/skypilot/train-multinode.yaml runs on both nodes as SkyPilot
would run it (issue 33): its own daemon per node, a notice, the bucket, a relaunch on fresh nodes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from spotguard_daemon.proctree import descendants

from _bucket import Bucket
from _twonodes import JOB, netns_available, two_nodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, NPROC, SAVE = 40, 2, 10
WIDTH = ("--width", "65536")
"""A 2 MiB first layer: the leaders' model and optimizer files are written with O_DIRECT, which
tmpfs takes since Linux 6.6 (before, the checkpoint engine falls back to buffered writes)."""
ARGS = ("--steps", str(STEPS), "--save-every", "20", *WIDTH)
LOST = ("--steps", str(STEPS), "--save-every", str(SAVE), "--keep", "1", *WIDTH)
"""The job killed mid-upload: a save every 10 steps (the cadence does not change the training), one
local checkpoint kept: node a holds only step 20 when node b dies, node c only what it fetches."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = netns_available()
    if why:
        pytest.skip(f"MULTI-NODE TESTS SKIPPED: {why}")
    work = tmp_path_factory.mktemp("multinode-local")
    bucket = Bucket(work)
    try:
        with two_nodes(work, bucket=bucket, node_local=True, hold_b=True) as cluster:
            cluster.bucket = bucket
            yield cluster
    finally:
        bucket.close()


@pytest.fixture(scope="module")
def runs(cluster):
    work = cluster.workdir
    roots = [work / "local-a", work / "local-b"]
    # The reference runs first, alone: the notice goes to every job of node b's daemon, so a
    # reference still running when it came (under load) would stop too (a failure, 1 of 5, had
    # been seen with the two running side by side).
    reference = cluster.launch("reference", "ref", *ARGS, nproc=NPROC, roots=roots)
    assert reference.wait(300) == [0, 0], reference.output()
    stopped = cluster.launch("stopped", "job", *ARGS, "--step-sleep", "0.25", nproc=NPROC, roots=roots)
    stopped.wait_for("progress", 1, lambda e: e["step"] >= 3)
    cluster.nodes[1].notify(deadline=60)
    stopped_codes = stopped.wait(180)
    durable = cluster.bucket.durable()
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


def wait_until(what: str, check, job, timeout: float = 120.0) -> None:
    """Wait for ``check()`` with every agent of ``job`` still running."""
    deadline = time.monotonic() + timeout
    while not check():
        assert all(launch.proc.poll() is None for launch in job.launches), f"an agent exited before {what}:\n{job.output()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s:\n{job.output()}"
        time.sleep(0.1)


SKYPILOT_TASK = Path(__file__).resolve().parents[2] / "deploy" / "skypilot" / "train-multinode.yaml"


def skypilot_run(cluster, name: str, homes: list[Path], train_args: str) -> list[subprocess.Popen]:
    """The `run` script of deploy/skypilot/train-multinode.yaml on both nodes, with the variables
    SkyPilot sets (node rank, node IPs one a line, node count, GPUs per node) and the task's envs,
    the bucket and job id replaced by the emulator's; each node's own HOME (its daemon's state and
    sockets) and CKPT_DIR (its local disk); train.py is the multi-node test job."""
    task = yaml.safe_load(SKYPILOT_TASK.read_text())
    ips = "\n".join(node.addr for node in cluster.nodes)
    procs = []
    for node, home in zip(cluster.nodes, homes):
        home.mkdir(parents=True)
        (home / "train.py").symlink_to(JOB)
        env = {**{k: str(v) for k, v in task["envs"].items()}, **node.extra_env,
               "SKYPILOT_NODE_RANK": str(node.index), "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NUM_NODES": "2",
               "SKYPILOT_NUM_GPUS_PER_NODE": str(NPROC), "HOME": str(home), "CKPT_DIR": str(home / "ckpt"),
               "SPOTGUARD_RUNTIME_DIR": f"{node.runtime_dir}-{home.name}",  # the script's own daemon
               "SPOTGUARD_JOB_ID": "skypilot-job", "TRAIN_ARGS": train_args,
               "SPOTGUARD_RECORD": str(cluster.workdir / f"{name}.jsonl"),
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        with open(cluster.workdir / f"{name}-{node.name}.log", "ab") as out:
            procs.append(subprocess.Popen(["ip", "netns", "exec", node.name, "bash", "-c", task["run"]],
                                          cwd=home, env={**node.env(), **env}, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def end_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launch's whole process tree, by pid (the node goes: SkyPilot's teardown)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def test_skypilot_run_script_through_a_notice_and_a_relaunch_on_fresh_nodes(cluster, runs):
    """deploy/skypilot/train-multinode.yaml's `run` on both nodes: a notice on node b stops every
    rank at one step and the bucket gets it; node b's script waits for the reclaim; SkyPilot ends
    the cluster and relaunches on two fresh nodes (new local disks, new daemons), which resume
    from the bucket at the stop's step and end bit-identical to the reference."""
    work = cluster.workdir / "skypilot"
    from spotguard import _record

    def events(name: str, kind: str) -> list[dict]:
        path = cluster.workdir / f"{name}.jsonl"
        return [e for e in _record.read(path) if e["event"] == kind] if path.exists() else []

    first = skypilot_run(cluster, "sky-stopped", [work / "a1", work / "b1"], " ".join((*ARGS, "--step-sleep", "0.25")))
    try:
        deadline = time.monotonic() + 120
        while not any(e["step"] >= 3 for e in events("sky-stopped", "progress")):
            assert all(p.poll() is None for p in first) and time.monotonic() < deadline, _sky_logs(cluster, "sky-stopped")
            time.sleep(0.1)
        b = cluster.nodes[1]
        out = subprocess.run(["ip", "netns", "exec", b.name, sys.executable, "-m", "spotguard_daemon", "notify",
                              "--kind", "preempt", "--deadline", "60", "--timeout", "10"],
                             env={**b.env(), "SPOTGUARD_RUNTIME_DIR": f"{b.runtime_dir}-b1"},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        durable = cluster.bucket.durable()
        deadline = time.monotonic() + 180
        while not durable.list("skypilot-job") and time.monotonic() < deadline:
            time.sleep(0.2)
        stops = {e["step"] for e in events("sky-stopped", "stop")}
        assert len(stops) == 1 and durable.list("skypilot-job") == list(stops), _sky_logs(cluster, "sky-stopped")
        assert first[1].poll() is None  # node b's script waits for the cloud to take the node
    finally:
        for proc in first:
            end_tree(proc)
    second = skypilot_run(cluster, "sky-resumed", [work / "a2", work / "b2"], " ".join(ARGS))
    try:
        assert [p.wait(300) for p in second] == [0, 0], _sky_logs(cluster, "sky-resumed")
    finally:
        for proc in second:
            if proc.poll() is None:
                end_tree(proc)
    assert {e["resumed_from"] for e in events("sky-resumed", "start")} == stops
    final = {e["digest"] for e in events("sky-resumed", "finish")}
    assert len(final) == 1 and final == {e["digest"] for e in runs["reference"].events("finish")}


def _sky_logs(cluster, name: str) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(cluster.workdir.glob(f"{name}-*.log")))


def test_node_b_killed_mid_upload_leaves_the_step_uncommitted_and_the_relaunch_resumes_bit_identical(cluster, runs):
    """Runs last: it kills node b (node c takes its namespace)."""
    a, b = cluster.nodes
    bucket, job = cluster.bucket, "multinode-lost"
    roots = [cluster.workdir / "local-a", cluster.workdir / "local-b"]
    b.relay.hold_after(job, SAVE)
    lost = cluster.launch("lost", "lost", *LOST, "--step-sleep", "0.25", "--peer-timeout", "5",
                          nproc=NPROC, roots=roots)
    parts = f"jobs/{job}/parts/step-{2 * SAVE:010d}/"
    a_part = lambda: any(k.rsplit("/", 1)[1].startswith("node-0.") for k in bucket.store.list(parts))  # noqa: E731
    wait_until("held upload of node b's step 20", b.relay.held.is_set, lost)
    wait_until("node a's part of step 20 in the store", a_part, lost)
    b.link_down()
    assert b.daemon.pid in b.kill_all()
    codes = lost.wait(120)
    out = lost.launches[0].output()
    assert codes[0] == 1 and re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", out, re.MULTILINE) == ["77"] * NPROC, out
    durable = bucket.durable()
    assert durable.list(job) == [SAVE] and durable.latest(job) == SAVE, b.daemon_log()[-3000:]

    b.relay.release()
    b.link_up()
    fresh = cluster.tmpfs(cluster.workdir / "local-c")
    b.start_fresh_daemon(fresh)
    resumed = cluster.launch("lost-resumed", "lost", *LOST, nproc=NPROC, roots=[roots[0], fresh])
    assert resumed.wait(300) == [0, 0], resumed.output()
    assert {e["resumed_from"] for e in resumed.events("start")} == {SAVE}, resumed.output()
    aside = [p.name for p in (roots[0] / "lost").glob("abandoned-step-*")]
    assert [n.rsplit("-", 1)[0] for n in aside] == [f"abandoned-step-{2 * SAVE:010d}"], aside
    final = {e["digest"] for e in resumed.events("finish")}
    assert len(final) == 1 and final == {e["digest"] for e in runs["reference"].events("finish")}, resumed.output()
