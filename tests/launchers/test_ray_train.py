"""spotguard inside Ray Train (spotguard.integrations.ray.RayRun) on a local Ray cluster: one
``ray.init()`` and one ``TorchTrainer.fit()`` (2 CPU workers, gloo, ``FailureConfig``) go through

1. a daemon notice mid-run (``spotguard notify --kind preempt``, the daemon's default signal
   delivery): every rank stops at one step, commits it and Ray restarts the workers; the daemon is
   then replaced by a fresh one (a fresh node: the old node's notice stays behind);
2. a SIGTERM to one worker process (Ray runs the loop in a thread; RayRun's handlers in the actor's
   main thread turn it into a stop with a save instead of Ray's own exit);
3. a SIGKILL of one worker process (no notice): Ray restarts the workers, which resume from the
   last periodic commit;
and ends with the state of an uninterrupted run computed here without Ray, bit for bit, with 0
steps redone after (1) and (2), at most a save interval after (3), and Ray's reported checkpoint =
spotguard's newest commit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from spotguard.integrations.ray import POINTER  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOTAL, EVERY = 40, 5


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _grads(model, step: int, rank: int) -> list:
    model.zero_grad()
    x, y = _batch(step, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def reference() -> dict:
    model, opt = _model_and_optimizer()
    for step in range(TOTAL):
        g0, g1 = _grads(model, step, 0), _grads(model, step, 1)
        for p, a, b in zip(model.parameters(), g0, g1):
            p.grad = (a + b) / 2
        opt.step()
    return model.state_dict()


def train_loop(config: dict) -> None:
    import torch.distributed as dist
    import ray.train
    from spotguard.integrations.ray import RayRun, RayStopped

    torch.set_num_threads(1)
    work = Path(config["work"])
    rank = ray.train.get_context().get_world_rank()
    while (work / "hold").exists():  # the test swaps the node's daemon
        time.sleep(0.05)
    (work / f"pid-{rank}").write_text(str(os.getpid()))
    model, opt = _model_and_optimizer()
    run = RayRun(config["root"], model=model, optimizer=opt, save_every=EVERY, peer_timeout=20.0)
    phase = next((p for p in ("notice", "term", "kill") if not (work / p).exists()), None)
    action_at = None
    with open(work / f"steps-{rank}", "a") as log:
        for step in run.steps(TOTAL):
            action_at = step + 3 if action_at is None else action_at
            time.sleep(0.03)  # a step of 30 ms: ranks agree every couple of steps
            log.write(f"{os.getpid()} {step}\n")
            log.flush()
            for p, g in zip(model.parameters(), _grads(model, step, rank)):
                dist.all_reduce(g)
                p.grad = g / dist.get_world_size()
            opt.step()
            if rank == 0 and step == action_at and phase is not None:
                (work / phase).touch()
                peer = int((work / "pid-1").read_text())
                if phase == "notice":
                    subprocess.run([sys.executable, "-m", "spotguard_daemon", "notify", "--kind", "preempt"],
                                   check=True, capture_output=True)
                else:
                    os.kill(peer, signal.SIGTERM if phase == "term" else signal.SIGKILL)
    try:
        run.finish()
    except RayStopped:
        if rank == 0 and phase == "notice":
            (work / "hold").touch()  # before Ray can restart the workers
        raise
    if rank == 0:
        torch.save(model.state_dict(), work / "final.pt")


def _attempts(path: Path) -> list[list[int]]:
    runs: dict[str, list[int]] = {}
    for line in path.read_text().split("\n"):
        if line:
            pid, step = line.split()
            runs.setdefault(pid, []).append(int(step))
    return list(runs.values())


def test_ray_train_notice_sigterm_and_sigkill(daemon_factory, tmp_path):
    import ray.cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": "none"})  # default signal delivery
    work = tmp_path / "work"
    work.mkdir()
    root = daemon.checkpoint_root / "job"
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"SPOTGUARD_RUNTIME_DIR": str(daemon.runtime_dir),
                                       "SPOTGUARD_ZMQ__HEARTBEAT_INTERVAL": "0.2",
                                       "PYTHONPATH": os.pathsep.join(sys.path)}})
    try:
        trainer = TorchTrainer(
            train_loop, train_loop_config={"work": str(work), "root": str(root)},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(name="sg-ray-test", storage_path=str(tmp_path / "ray"),
                                 failure_config=FailureConfig(max_failures=3),
                                 checkpoint_config=CheckpointConfig(num_to_keep=None)))
        result: dict = {}
        fit = threading.Thread(target=lambda: result.update(r=trainer.fit()), daemon=True)
        fit.start()
        while fit.is_alive():
            if (work / "hold").exists():  # the stopped node goes; a fresh node's daemon answers
                daemon.kill()
                shutil.rmtree(daemon.state_dir, ignore_errors=True)
                daemon.start()
                (work / "hold").unlink()
            fit.join(0.05)
        print(f"Ray session (init + fit with 3 restarts): {time.monotonic() - started:.1f} s")
    finally:
        ray.shutdown()
    ray_result = result["r"]
    assert ray_result.error is None, ray_result.error
    final = torch.load(work / "final.pt")
    expected = reference()
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    for rank in (0, 1):
        attempts = _attempts(work / f"steps-{rank}")
        assert len(attempts) == 4, attempts
        for before, after in zip(attempts[:2], attempts[1:3]):  # the notice, the SIGTERM
            assert after[0] == before[-1] + 1, (before, after)  # 0 steps redone
        killed, resumed = attempts[2], attempts[3]  # the SIGKILL: back to the last commit, a save interval at most
        assert killed[-1] - EVERY < resumed[0] <= killed[-1] + 1, (killed, resumed)
        assert attempts[-1][-1] == TOTAL - 1
    # Ray's latest checkpoint points to spotguard's newest commit
    pointer = json.loads((Path(ray_result.checkpoint.path) / POINTER).read_text())
    assert pointer["step"] == TOTAL and pointer["job_id"] == "ray-sg-ray-test"
    assert Path(pointer["path"]) == root / f"step-{TOTAL:010d}"
