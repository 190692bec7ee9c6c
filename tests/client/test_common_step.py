"""Issue 28 item 1: node-local roots relaunched after a node's daemon died (real torchrun, gloo, CPU).

Two ranks, each with a checkpoint root of its own (two nodes of node-local roots). The bucket holds
step 10 globally (both nodes' parts), and nothing later: node b's daemon died after it. Node a's
retention then kept only steps 30-50; node b is replaced by a fresh node with an empty disk.

* Before, every rank raised "none of the 3 checkpoints ... is valid". Now the ranks agree on the
  newest step every rank holds or can fetch (10), node a fetches it too, and both resume from it
  with the weights saved at step 10; node a's newer steps are set aside, not loaded, not deleted.
* Without the store, the ranks share no step: the error says what each rank holds.
* The peer tier (issue 30): with partners that hold nothing for the fresh node's ranks (both copies
  lost at once), the relaunch falls back to the store and says so in one line; with a partner that
  holds node b's step 50, the fresh node restores it from the partner and both resume from 50.

This file is also the worker script: torchrun runs it with ``<root> <out> <steps>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.storage.peer import PeerClient
from spotguard_daemon.core.peer_server import PeerServer

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

pytestmark = [pytest.mark.timeout(300)]
SECRET = "a-secret-the-two-nodes-share"


def worker(root: str, out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import spotguard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    result: dict = {"weights": {}}
    record = Path(out, f"rank{rank}.json")
    try:
        with spotguard.Run(os.path.join(root, f"node-{rank}"), model=model, optimizer=opt, job_id="job",
                           save_every=10, keep=int(os.environ["JOB_KEEP"]), daemon=False,
                           durable=os.environ.get("JOB_DURABLE") or None, peer_timeout=60) as run:
            for step in run.steps(steps):
                if "resumed" not in result:
                    result["resumed"] = run.resumed_from.step if run.resumed_from else None
                    result["loaded"] = model.weight.tolist()
                opt.zero_grad()
                model(torch.full((2, 4), step / 100)).square().mean().backward()
                opt.step()
                result["weights"][step] = model.weight.tolist()
    except Exception as exc:  # noqa: BLE001 - told to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
    record.write_text(json.dumps(result))
    dist.destroy_process_group()


def torchrun(tmp: Path, root: Path, out: str, steps: int, **knobs: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    env.update(knobs, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME="lo",
               SPOTGUARD_RUNTIME_DIR=str(tmp / "no-daemon"))
    (tmp / out).mkdir()
    cmd = [*TORCHRUN, "--standalone", "--max-restarts", "0", "--nproc-per-node", "2", __file__, str(root),
           str(tmp / out), str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return [json.loads((tmp / out / f"rank{r}.json").read_text()) for r in range(2)], done.stderr


def test_a_relaunch_after_a_dead_daemon_agrees_on_the_newest_step_every_rank_can_fetch(tmp_path, request):
    from spotguard.storage import Durable
    from spotguard.storage.file import FileStore

    ckpt, bucket = tmp_path / "ckpt", FileStore(tmp_path / "bucket")
    first, _ = torchrun(tmp_path, ckpt, "first", 50, JOB_KEEP="5")
    assert all("error" not in r for r in first), first
    durable = Durable(bucket)
    for node in ("node-0", "node-1"):  # both daemons uploaded step 10; then node b's died
        durable.upload(ckpt / node / "step-0000000010", "job")
    assert durable.latest("job") == 10
    for step in (10, 20):  # node a's retention (keep 3) since
        shutil.rmtree(ckpt / "node-0" / f"step-{step:010d}")
    shutil.copytree(ckpt / "node-0", tmp_path / "node-a-only" / "node-0")
    jobs = {"job"}
    holding = PeerServer(tmp_path / "peer-a", SECRET, keep=2, timeout=30, jobs=lambda: jobs)
    empty = PeerServer(tmp_path / "peer-empty", SECRET, keep=2, timeout=30, jobs=lambda: jobs)
    holding_url, empty_url = ("http://%s:%d" % server.start("127.0.0.1", 0) for server in (holding, empty))
    request.addfinalizer(holding.close), request.addfinalizer(empty.close)  # closed whatever fails
    with PeerClient(holding_url, SECRET, "job") as client:  # node b's daemon had copied its step 50 to a
        client.push("ranks-1", 50, ckpt / "node-1" / "step-0000000050")
    shutil.rmtree(ckpt / "node-1")  # node b is gone: a fresh node c with an empty disk

    relaunch, said = torchrun(tmp_path, ckpt, "relaunch", 12, JOB_KEEP="3", JOB_DURABLE=bucket.url,
                              SPOTGUARD_PEER__PARTNERS=empty_url, SPOTGUARD_PEER__SECRET=SECRET)
    assert [r.get("error") for r in relaunch] == [None, None], relaunch
    assert [r["resumed"] for r in relaunch] == [10, 10]
    assert relaunch[0]["loaded"] == relaunch[1]["loaded"] == first[0]["weights"]["9"]  # the state after 10 steps
    aside = sorted(p.name.rsplit("-", 1)[0] for p in (ckpt / "node-0").glob("abandoned-*"))
    assert aside == [f"abandoned-step-{s:010d}" for s in (30, 40, 50)], aside
    assert "the ranks agree on step 10, which this node lacks" in said
    assert said.count(f"no partner ({empty_url}) holds step 10 of ranks-1; fetching it from the store") == 1, said

    alone, _ = torchrun(tmp_path, tmp_path / "node-a-only", "alone", 12, JOB_KEEP="3")
    errors = [r.get("error") or "" for r in alone]
    assert all("no checkpoint step is held by every rank" in e for e in errors), errors
    assert "rank 0: 3 checkpoints (steps 30..50); rank 1: none" in errors[0], errors[0]

    peer, said = torchrun(tmp_path, tmp_path / "node-a-only", "peer", 52, JOB_KEEP="3",
                          SPOTGUARD_PEER__PARTNERS=holding_url, SPOTGUARD_PEER__SECRET=SECRET)
    assert [r.get("error") for r in peer] == [None, None], peer
    assert [r["resumed"] for r in peer] == [50, 50]
    assert peer[0]["loaded"] == peer[1]["loaded"] == first[0]["weights"]["49"]  # the state after 50 steps
    assert f"restored from the peer {holding_url}" in said


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))


def test_a_relaunch_that_sets_steps_aside_deletes_what_an_earlier_one_set_aside(tmp_path, caplog):
    """One abandoned run is kept at most: relaunch after relaunch on a node must not fill its disk."""
    import torch
    from spotguard._run_common import _set_aside
    from spotguard.checkpoint import Checkpointer

    root = tmp_path / "node"
    with Checkpointer(root, keep=5, background_nice=None, background_cpu_share=None) as ck:
        for step in (10, 20, 30):
            ck.save(step, {"w": torch.full((4,), float(step))})
            ck.wait()
    earlier = root / "abandoned-step-0000000050-1700000000"
    (earlier / "rank-0").mkdir(parents=True)
    (earlier / "rank-0" / "big.bin").write_bytes(b"x" * 4096)
    outside = tmp_path / "not-ours"
    outside.mkdir()
    (root / "abandoned-step-0000000060-1700000000").symlink_to(outside)  # a link is left alone
    with caplog.at_level("WARNING", logger="spotguard.run"):
        _set_aside(root, 10)
    aside = sorted(p.name.rsplit("-", 1)[0] for p in root.glob("abandoned-step-*") if not p.is_symlink())
    assert aside == ["abandoned-step-0000000020", "abandoned-step-0000000030"], aside
    assert not earlier.exists() and outside.is_dir()
    assert "deleted 1 step(s) an earlier relaunch had set aside (abandoned-step-0000000050-1700000000)" in caplog.text
    with Checkpointer(root) as ck:
        assert ck.load_latest({"w": torch.zeros(4)}).step == 10
    _set_aside(root, 10)  # nothing newer to set aside: what is aside stays
    assert len([p for p in root.glob("abandoned-step-*") if not p.is_symlink()]) == 2
