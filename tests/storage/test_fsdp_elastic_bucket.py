"""Issue 28 item 8: FSDP2 saved on node-local roots, resumed elastically through the bucket.

Real ``torchrun`` (gloo, CPU) runs ``tests/client/test_elastic_resume.py``'s FSDP2 worker
(``fully_shard`` + AdamW through ``get_state_dict``): 2 nodes x 2 ranks, each node a checkpoint root
of its own (node-local mode), save a step; each node's part goes to the S3 emulator with
``Durable.upload``, as each node's daemon uploads it. Then:

* **1 x 3** on node 0's root (it holds saved ranks 0 and 1): the ranks reshard, reading saved ranks
  2 and 3's shards from the bucket: rank 0, whose new shards lie in ranks 0-1's, reads no chunk;
  ranks 1 and 2 read exactly the saved chunks their new shards overlap.
* **3 x 1**, node 0's root and two fresh nodes: each fresh node fetches its ranks' parts and rank
  0's without any sharded file; every rank reads the chunks it needs from the bucket.

Every parameter and optimizer tensor loaded, gathered in full, equals the saved one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.storage import Durable

WORKER = Path(__file__).resolve().parents[1] / "client" / "test_elastic_resume.py"
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")]


def torchrun(ranks: int, root: Path, out: Path, tag: str, **knobs: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    env.update(knobs, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME="lo")
    cmd = [TORCHRUN, "--standalone", "--max-restarts", "0", "--nproc-per-node", str(ranks), str(WORKER),
           "fsdp", str(root), str(out), tag]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    Path(out, f"{tag}.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done.stdout + done.stderr


def _dcp_bytes(root: Path, ranks: list[int]) -> int:
    """The size of the saved data files (not the metadata) of ``ranks``' DCP parts under ``root``."""
    return sum(p.stat().st_size for r in ranks for p in root.glob(f"**/step-*/rank-{r}/dcp/__*"))


@pytest.mark.timeout(300)  # three torchrun launches (10 ranks in all), 20-45 s each on 2 loaded cores
def test_fsdp2_on_node_local_roots_reshards_from_the_bucket_2x2_to_1x3_and_3x1(moto, new_bucket, tmp_path):
    store = new_bucket("s3", moto.url)
    knobs = {"JOB_STORE_URL": store.url, "JOB_STORE_ENDPOINT": moto.url}
    saved, out = tmp_path / "saved", tmp_path / "out"
    out.mkdir()
    torchrun(4, saved, out, "a", JOB_RANKS_PER_NODE="2", **knobs)
    durable = Durable(store)
    for node in ("node-0", "node-1"):  # as each node's daemon: node 0's part first, then node 1's
        (step_dir,) = (saved / node).glob("step-*")
        assert durable.upload(step_dir, "fsdp").objects_uploaded > 0
    assert durable.latest("fsdp") == 1
    expected = json.loads((out / "a-saved.json").read_text())

    cases = {"b": (3, "3", ["node-0"]), "c": (3, "1", ["node-0"])}
    for tag, (ranks, per, kept) in cases.items():
        root = tmp_path / tag
        for node in kept:  # node 0's disk survives; every other node is fresh
            shutil.copytree(saved / node, root / node)
        said = torchrun(ranks, root, out, tag, JOB_RANKS_PER_NODE=per, **knobs)
        assert "saved by 4 ranks, this job has 3" in said
        loaded = json.loads((out / f"{tag}-loaded.json").read_text())
        assert sorted(loaded) == sorted(expected) and any(k.startswith("o.") for k in expected)
        for name in expected:  # every parameter and optimizer tensor, gathered in full
            assert loaded[name] == expected[name], (tag, name)
        fetched = [json.loads((out / f"{tag}-fetched-rank{r}.json").read_text()) for r in range(ranks)]
        # Rows of each tensor: saved rank r held [6r, 6r + 6) of 24, new rank r holds [8r, 8r + 8).
        # New rank 0 (node 0's disk) needs saved ranks 0-1's, on its disk: it reads no chunk. New rank 1
        # needs saved ranks 1-2's, rank 2 saved ranks 2-3's: they read those chunks from the store,
        # byte for byte, and no other (saved rank 1's too where its node's disk lacks it: 3 x 1).
        assert fetched[0]["chunks"] == 0, fetched
        need = {1: [2] if tag == "b" else [1, 2], 2: [2, 3]}
        for r, saved_ranks in need.items():
            assert fetched[r]["ranges"] == _dcp_bytes(saved, saved_ranks), (tag, r, fetched)
        if tag == "c":  # 3 x 1: the fresh nodes fetched no sharded file, only the rest of their ranks'
            for node in ("node-1", "node-2"):
                files = [p.relative_to(root / node) for p in (root / node).glob("step-0000000001/rank-*/**/*") if p.is_file()]
                assert files and not any("dcp" in p.parts for p in files), files
