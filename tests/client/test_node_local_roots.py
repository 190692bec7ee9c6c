"""Node-local checkpoint roots (issue 24, item 1), under real ``torchrun`` (gloo, CPU).

Two torchrun agents on this machine stand for two nodes, each giving its own ``--ckpt-dir`` (no
directory is shared). Every save commits on each node a node-local manifest of that node's parts
(the node's leader also carries the replicated state). Both nodes' parts of the stop's step go to
the store (``Durable.upload``, as each node's daemon does), then the identical command runs on node
a and a fresh node c (empty root, the store given): node c fetches the globally committed step, all
ranks agree on it, and the job ends bit-identical to the same job on one shared directory.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _example import isolated_env
from spotguard.storage import Durable, open_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # three launches on a loaded CI

JOB = Path(__file__).with_name("_node_local_job.py")
FINAL = re.compile(r"^rank=(\d) final step=(\d+) digest=([0-9a-f]{64})$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(home: Path, *args: str, names: tuple[str, str] = ("a", "b"), **env: str) -> list[subprocess.Popen]:
    """One torchrun agent per "node", each with its own checkpoint root ``home/node-<name>``."""
    port, procs = free_port(), []
    for k, name in enumerate(names):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={k}",
                "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", str(JOB),
                "--ckpt-dir", str(home / f"node-{name}"), *args]
        procs.append(subprocess.Popen(argv, env=isolated_env(home / f"rt-{name}", **env), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def finish(procs: list[subprocess.Popen]) -> str:
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=400)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = "\n".join(outs)
    assert [p.returncode for p in procs] == [0] * len(procs), text
    return text


def finals(text: str) -> dict[int, tuple[int, str]]:
    return {int(rank): (int(step), digest) for rank, step, digest in FINAL.findall(text)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    home = tmp_path_factory.mktemp("node-local")
    shared = home / "shared"
    reference = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node=2", str(JOB), "--ckpt-dir", str(shared), "--steps", "12"],
                                  env=isolated_env(home / "rt-ref"), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
    nodes = home / "nodes"
    stopped = two_nodes(nodes, "--steps", "12", "--stop-at", "6")
    out = {"reference": finish(reference), "stopped": finish(stopped)}
    out["stopped_dirs"] = {k: sorted(p.name for p in (nodes / f"node-{k}").iterdir()) for k in "ab"}
    bucket = Durable(open_store(f"file://{home}/bucket"))
    for k in "ab":  # what each node's daemon does with its node's commit
        bucket.upload(nodes / f"node-{k}" / "step-0000000006", "job")
    out["global"] = bucket.list("job")
    out["resumed"] = finish(two_nodes(nodes, "--steps", "12", names=("a", "c"), SPOTGUARD_JOB_ID="job",
                                      SPOTGUARD_STORAGE__URL=f"file://{home}/bucket"))
    out["nodes"], out["shared"] = nodes, shared
    return out


def test_each_node_commits_its_own_parts_in_a_node_local_manifest(runs):
    assert runs["stopped_dirs"] == {k: ["latest", "step-0000000004", "step-0000000006"] for k in "ab"}
    assert runs["global"] == [6]  # one global manifest, once both nodes' parts were in the store
    stopped = finals(runs["stopped"])
    assert {r: s for r, (s, _) in stopped.items()} == {0: 6, 1: 6}, runs["stopped"]
    for k, name in enumerate("ac"):
        manifest = json.loads((runs["nodes"] / f"node-{name}" / "step-0000000012" / "manifest.json").read_text())
        node = manifest["node"]
        assert (node["index"], node["nodes"], node["leader"], node["ranks"]) == (k, 2, k, [k])
        assert {rel.split("/")[0] for rel in manifest["files"]} == {f"rank-{k}"}  # only its own parts
        assert len(node["digests"]) == 2 and manifest["world_size"] == 2
        tree = json.loads((runs["nodes"] / f"node-{name}" / "step-0000000012" / f"rank-{k}" / "tree.json").read_text())
        assert {"model", "optimizer"} <= {name for name, *_ in tree["entries"]}  # the leader's replicated state
    shared = json.loads((runs["shared"] / "step-0000000012" / "manifest.json").read_text())
    assert "node" not in shared and {rel.split("/")[0] for rel in shared["files"]} == {"rank-0", "rank-1"}


def part_digest(step_dir: Path, rank: int) -> str:
    return json.loads((step_dir / f"rank-{rank}" / "part.json").read_text())["digest"]


def test_the_relaunch_on_node_a_and_a_fresh_node_ends_bit_identical_to_one_shared_directory(runs):
    resumed = finals(runs["resumed"])
    assert sorted(resumed) == [0, 1] and {s for s, _ in resumed.values()} == {12}, runs["resumed"]
    assert len(set(resumed.values())) == 1  # both nodes hold the same global digest
    assert "resuming" in runs["resumed"] and "step-0000000006" in runs["resumed"]
    # A part's digest covers what it holds: in a shared directory only rank 0's part carries the
    # replicated state, so the two modes compare by rank 0's part (model, optimizer, data, its RNG).
    final = "step-0000000012"
    fetched = json.loads((runs["nodes"] / "node-c" / "step-0000000006" / "manifest.json").read_text())
    assert fetched["node"] == {"leader": 0, "ranks": [0, 1], "restored": True}  # node c fetched the global step
    assert part_digest(runs["nodes"] / "node-a" / final, 0) == part_digest(runs["shared"] / final, 0)
