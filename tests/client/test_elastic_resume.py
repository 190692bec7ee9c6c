"""Elastic resume under real ``torchrun`` (gloo, CPU): a job relaunched on another world size.

* DDP through ``spotguard.Run`` and ``spotguard.DataLoader``: 2 nodes x 2 ranks, each node with a
  checkpoint directory of its own (node-local mode), train 3 steps and finish (committing step 3);
  relaunched as 1 node x 2 ranks and 1 x 3 on the first node's directory (it holds ranks 0 and 1's
  parts only), the loaded model and optimizer equal the saved ones, and the samples the relaunch
  draws (each batch carries its sample ids) are exactly the rest of the epoch: with the first
  launch's, every sample once.
* torchrun's elastic range (``--nnodes 1:2``, two agents as two nodes): one node SIGKILLed
  mid-run, the survivor's rank leaves the failed agreement (77), its agent restarts it in a
  rendezvous of one, and it resumes on 1 rank from the 2-rank checkpoint.
* FSDP2 (``fully_shard`` + AdamW through ``get_state_dict``/``set_state_dict``): saved by 4 ranks and
  loaded by 2, saved by 2 and loaded by 3; every parameter and optimizer tensor loaded equals the
  saved full tensor.

This file is also the worker script: torchrun runs it with ``ddp|fsdp <root> <out> <steps>``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
N = 24  # samples in the epoch of the rendezvous test (JOB_SAMPLES sets the worker's)
N_WIDE = 48  # the DDP tests': 4 ranks x batch 2 x 3 steps consume the first 24
pytestmark = [pytest.mark.slow, pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")]


def _tensors(model, opt) -> dict[str, list]:
    """Full (gathered) parameters and optimizer state tensors, as lists, by name."""
    import torch

    def full(t):
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        return t.detach().float().reshape(-1).tolist()
    out = {f"p.{n}": full(p) for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for key, value in sorted(opt.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                out[f"o.{i}.{key}"] = full(value)
    return out


def ddp_worker(root: str, out: str, steps: int) -> None:
    """Trains through Run; after each step writes ``w<world>.rank<rank>.json``: the full model and
    optimizer as loaded, the ids each step drew (with its epoch), and the state now."""
    import time

    import torch
    import torch.distributed as dist

    import spotguard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    samples = int(os.environ.get("JOB_SAMPLES", N))

    class Ids(torch.utils.data.Dataset):
        def __len__(self):
            return samples

        def __getitem__(self, i):
            return i, torch.full((4,), float(i) / samples)

    loader = spotguard.DataLoader(Ids(), batch_size=2, shuffle=True, seed=0)
    result: dict = {"ids": {}}
    pause = float(os.environ.get("JOB_STEP_SLEEP", "0"))
    save_every = int(os.environ.get("JOB_SAVE_EVERY", "100"))
    record = Path(out, f"w{dist.get_world_size()}.rank{rank}.json")
    root = os.path.join(root, f"node-{rank // int(os.environ.get('JOB_RANKS_PER_NODE', '1000'))}")
    with spotguard.Run(root, model=model, optimizer=opt, loader=loader, save_every=save_every,
                       peer_timeout=30) as run:
        for step in run.steps(steps):
            if "loaded" not in result:
                result["loaded"] = _tensors(model.module, opt)
            ids, x = next(iter_once(loader))
            result["ids"][step] = [loader.sampler.epoch, ids.tolist()]
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            result["final"] = _tensors(model.module, opt)
            record.write_text(json.dumps(result))
            time.sleep(pause)
    dist.destroy_process_group()


_ITERS: dict = {}


def iter_once(loader):
    """One iterator over the loader for the whole run, a new epoch when it ends."""
    it = _ITERS.get(id(loader))
    if it is None:
        def endless():
            while True:
                yield from loader
                loader.sampler.set_epoch(loader.sampler.epoch + 1)
        it = _ITERS[id(loader)] = endless()
    return it


def fsdp_worker(root: str, out: str, tag: str) -> None:
    """Load the latest checkpoint if any (rank 0 writes the full tensors loaded to
    ``<tag>-loaded.json``), train a step, save it (full tensors saved: ``<tag>-saved.json``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from spotguard.checkpoint import Checkpointer

    import logging

    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 12))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    class App:
        def state_dict(self):
            msd, osd = get_state_dict(model, opt)
            return {"model": msd, "optim": osd}

        def load_state_dict(self, sd):
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    state = {"app": App()}
    per = int(os.environ.get("JOB_RANKS_PER_NODE", "0"))  # node-local roots: node-<k> of `per` ranks each
    root = os.path.join(root, f"node-{rank // per}") if per else root
    ck = Checkpointer(root, process_group=dist.group.WORLD, timeout=60)
    fetched = _from_bucket(ck, root, rank, per, world) if os.environ.get("JOB_STORE_URL") else None
    App().state_dict()  # optimizer state to load into, as get_state_dict creates it
    info = ck.load_latest(state)
    dumps = {"loaded": _tensors(model, opt)} if info else {}
    torch.manual_seed(100 + rank)
    opt.zero_grad()
    model(torch.randn(4, 12)).square().mean().backward()
    opt.step()
    ck.save((info.step if info else 0) + 1, state)
    ck.wait()
    dumps["saved"] = _tensors(model, opt)
    for what, tensors in dumps.items():
        if rank == 0:
            Path(out, f"{tag}-{what}.json").write_text(json.dumps(tensors))
    if fetched is not None:
        Path(out, f"{tag}-fetched-rank{rank}.json").write_text(json.dumps(fetched))
    ck.close()
    dist.destroy_process_group()


def _from_bucket(ck, root: str, rank: int, per: int, world: int) -> dict:
    """As ``spotguard.Run`` does with a store (``$JOB_STORE_URL``): the node's leader fetches what
    the store holds newer than its root (its ranks' parts and rank 0's, no sharded files when
    resized), and a resharding load reads the other nodes' shards from the store. Returns what this
    rank reads from the store, counted: ``{"whole": bytes, "ranges": bytes, "chunks": n}``."""
    import torch.distributed as dist

    from spotguard.storage import StoreOptions, restore_newer
    from spotguard.storage.shards import from_store

    url, job = os.environ["JOB_STORE_URL"], "fsdp"
    options = StoreOptions(endpoint_url=os.environ.get("JOB_STORE_ENDPOINT") or None)
    if rank % per == 0:
        restore_newer(root, job, url, options, ranks=ck.node_ranks, world_size=world)
    dist.barrier()
    fetched = {"whole": 0, "ranges": 0, "chunks": 0}
    shards = from_store(url, job, options)

    def counted(step: int):
        remote = shards(step)
        whole, ranged = remote.read_whole, remote.read_range

        def read_whole(rel):
            data = whole(rel)
            fetched["whole"] += len(data)
            return data

        def read_range(rel, offset, length):
            data = ranged(rel, offset, length)
            fetched["ranges"] += len(data)
            fetched["chunks"] += 1
            return data

        remote.read_whole, remote.read_range = read_whole, read_range
        return remote

    ck.remote_shards = counted
    return fetched


def _env(**knobs: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    env.update(knobs, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME="lo")
    return env


def torchrun(ranks: int, *args: str, **knobs: str) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", "--max-restarts", "0", "--nproc-per-node", str(ranks), __file__, *args]
    done = subprocess.run(cmd, env=_env(**knobs), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done


def _ranks(out: Path, ranks: int) -> list[dict]:
    return [json.loads((out / f"w{ranks}.rank{r}.json").read_text()) for r in range(ranks)]


def _steps_done(record: Path) -> int:
    try:
        return len(json.loads(record.read_text())["ids"])
    except (OSError, ValueError):  # not there yet, or mid-write
        return 0


def _epoch0(records: list[dict], below: int = 10**9) -> list[int]:
    return [i for rec in records for step, (epoch, ids) in rec["ids"].items()
            if epoch == 0 and int(step) < below for i in ids]


@pytest.fixture(scope="module")
def ddp_saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("elastic")
    (base / "first").mkdir()
    torchrun(4, "ddp", str(base / "ckpt"), str(base / "first"), "3", JOB_RANKS_PER_NODE="2",
             JOB_SAMPLES=str(N_WIDE))
    (manifest,) = [json.loads(p.read_text()) for p in (base / "ckpt" / "node-0").glob("**/step-*/manifest.json")]
    assert {f.split("/")[0] for f in manifest["files"]} == {"rank-0", "rank-1"}  # node-local: this node's
    return base, _ranks(base / "first", 4)


@pytest.mark.parametrize(("ranks", "steps"), [(2, 9), (3, 7)])  # the rest of the epoch, exactly
def test_ddp_resumes_on_another_world_size_with_the_rest_of_the_epoch(ddp_saved, tmp_path, ranks, steps):
    base, first = ddp_saved
    shutil.copytree(base / "ckpt" / "node-0", tmp_path / "ckpt" / "node-0")  # the first node's disk
    (tmp_path / "out").mkdir()
    done = torchrun(ranks, "ddp", str(tmp_path / "ckpt"), str(tmp_path / "out"), str(steps),
                    JOB_RANKS_PER_NODE=str(ranks), JOB_SAMPLES=str(N_WIDE))
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if "elastic resume" in ln]
    assert len(lines) == 1 and "saved by 4 ranks, this job has %d" % ranks in lines[0], lines
    second = _ranks(tmp_path / "out", ranks)
    for rank in second:
        assert rank["loaded"] == first[0]["final"]  # replicated model and optimizer, as saved
    drawn = _epoch0(first) + _epoch0(second)
    assert sorted(drawn) == list(range(N_WIDE))  # every sample of the epoch, none twice, none skipped
    assert all(epoch == 0 for rank in second for epoch, _ in rank["ids"].values())
    assert sorted(int(s) for s in second[0]["ids"]) == list(range(3, steps))


@pytest.mark.timeout(240)
def test_an_elastic_rendezvous_restarts_the_survivor_on_fewer_ranks(tmp_path):
    """``--nnodes 1:2`` with two agents; node b (agent and worker) SIGKILLed after a commit: node
    a's rank exits 77 from the agreement, its agent re-rendezvouses alone and the job resumes on
    1 rank from the 2-rank checkpoint, the rest of the epoch drawn once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    def cmd(host: bool) -> list[str]:  # node a hosts the rendezvous store (it outlives b)
        return [TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic", "--max-restarts", "2",
                "--rdzv-conf", f"last_call_timeout=3,is_host={int(host)}", __file__, "ddp",
                str(tmp_path / "ckpt"), str(out), "12"]
    env = _env(JOB_STEP_SLEEP="0.5", JOB_SAVE_EVERY="2")
    logs = [open(tmp_path / f"{node}.log", "w") for node in "ab"]
    agents = [subprocess.Popen(cmd(host), env=env, stdout=log, stderr=subprocess.STDOUT)
              for host, log in zip((True, False), logs)]
    try:
        deadline = time.monotonic() + 150
        while _steps_done(out / "w2.rank1.json") < 4:
            assert time.monotonic() < deadline and agents[0].poll() is None, "the 2-node job never ran 4 steps"
            time.sleep(0.2)
        b = agents[1].pid
        children = Path(f"/proc/{b}/task/{b}/children").read_text().split()
        for pid in [*map(int, children), b]:
            os.kill(pid, signal.SIGKILL)
        assert agents[0].wait(150) == 0
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
            agent.wait()
        for log in logs:
            log.close()
    text = (tmp_path / "a.log").read_text()
    assert "exiting 77" in text and text.count("saved by 2 ranks, this job has 1") == 1, text[-3000:]
    (resumed,) = _ranks(out, 1)
    start = min(map(int, resumed["ids"]))
    drawn = _epoch0(_ranks(out, 2), start) + _epoch0([resumed])
    assert sorted(drawn) == list(range(N))  # the 2-rank steps kept, then the rest on 1 rank


@pytest.mark.timeout(300)  # three torchrun launches (9 ranks in all), 20-45 s each on 2 loaded cores
def test_fsdp2_reshards_4_to_2_and_2_to_3(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for ranks, tag, previous in ((4, "a", None), (2, "b", "a"), (3, "c", "b")):
        done = torchrun(ranks, "fsdp", str(tmp_path / "ckpt"), str(out), tag)
        if previous is None:
            continue
        assert f"saved by {dict(a=4, b=2)[previous]} ranks, this job has {ranks}" in done.stdout + done.stderr
        saved = json.loads((out / f"{previous}-saved.json").read_text())
        loaded = json.loads((out / f"{tag}-loaded.json").read_text())
        assert sorted(saved) == sorted(loaded) and any(k.startswith("o.") for k in saved)
        for name in saved:  # every parameter and optimizer tensor, gathered in full
            assert loaded[name] == saved[name], (tag, name)


if __name__ == "__main__":
    kind, root, out, arg = sys.argv[1:5]
    if kind == "ddp":
        ddp_worker(root, out, int(arg))
    else:
        fsdp_worker(root, out, arg)
