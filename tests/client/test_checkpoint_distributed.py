"""Two real ranks under ``torchrun --nproc-per-node 2`` (gloo): shared state written once by rank 0,
per-rank ``rng`` by every rank, one manifest, ranks agreeing through all_reduce only.

This file is also the worker script: torchrun runs it with ``worker <root> <out> <mode>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))


def worker(root: str, out: str, mode: str) -> None:
    import torch
    import torch.distributed as dist

    from spotguard.checkpoint import Checkpointer, CheckpointError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 1000)  # > 1 MiB of weights
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        ddp(torch.randn(4, 300)).sum().backward()  # gradient all_reduce on the training group
        opt.step()

    torch.manual_seed(100 + rank)
    ck = Checkpointer(root, process_group=dist.group.WORLD, job_id="dist", timeout=10 if mode == "fail" else 120)
    result: dict = {"rank": rank}
    if mode == "fail":
        state = {"model": model, "rng": {"bad": object()} if rank == 1 else {"r": rank}}
        try:
            ck.save(1, state, blocking=rank == 0)
        except CheckpointError as exc:
            result["error"] = type(exc).__name__
    else:
        step()
        ck.save(1, {"model": model, "optim": opt, "rng": {"r": torch.tensor([rank]), "gen": torch.get_rng_state()}})
        step()  # training collectives run while the background save runs its own
        ck.wait()
        expected_gen = torch.get_rng_state()
        ck.save(2, {"model": model, "optim": opt, "rng": {"r": torch.tensor([rank]), "gen": expected_gen}},
                blocking=True)
        fresh = torch.nn.Linear(300, 1000)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        rng: dict = {}
        info = Checkpointer(root, process_group=dist.group.WORLD).load_latest(
            {"model": fresh, "optim": fresh_opt, "rng": rng})
        result.update(step=info.step, r=int(rng["r"]), gen_equal=torch.equal(rng["gen"], expected_gen),
                      model_equal=torch.equal(fresh.weight, model.weight),
                      optim_equal=torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"],
                                              opt.state_dict()["state"][0]["exp_avg"]))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if mode != "fail":
        dist.destroy_process_group()
    os._exit(0)  # a broken gloo group can hang interpreter shutdown in the "fail" mode


def run_torchrun(tmp_path: Path, mode: str) -> tuple[Path, list[dict]]:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-port", "0", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", __file__, "worker", str(root), str(out), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-4000:]
    return root, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_two_ranks_save_one_checkpoint_and_restore_their_own_rng(tmp_path):
    root, results = run_torchrun(tmp_path, "ok")
    for r, res in enumerate(results):
        assert res == {"rank": r, "step": 2, "r": r, "gen_equal": True, "model_equal": True, "optim_equal": True}
    manifest = json.loads((root / "step-0000000002" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    files = set(manifest["files"])
    assert {"rank-0/part.json", "rank-1/part.json", "rank-0/tree.json", "rank-1/tree.json"} <= files
    assert any(f.startswith("rank-0/tensors/") for f in files)  # the model: rank 0 only
    assert not any(f.startswith("rank-1/tensors/") for f in files)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000000001", "step-0000000002"]


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_a_failing_rank_means_no_commit_and_an_error_within_the_timeout(tmp_path):
    root, results = run_torchrun(tmp_path, "fail")
    assert results[0]["error"] == "CheckpointError"
    assert results[1]["error"] == "UnsupportedStateError"
    assert list(root.iterdir()) == []  # not even the tmp dir is left behind


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(*sys.argv[2:5])
