"""spotguard.DataLoader in process: what it refuses, what it warns about, and the invariants the
matrix test relies on (global RNG untouched, position = batches handed out, lazy iterator)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader, Dataset, IterableDataset

import spotguard
from spotguard.sampler import SamplerStateError


class Noisy(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        return torch.tensor([float(i), torch.rand(()).item() + np.random.rand() + random.random()])


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(5)


def test_refuses_what_it_cannot_resume(tmp_path):
    with pytest.raises(TypeError, match="owns its generator"):
        spotguard.DataLoader(Noisy(), generator=torch.Generator())
    with pytest.raises(TypeError, match="ResumableSampler"):
        spotguard.DataLoader(Noisy(), sampler=torch.utils.data.RandomSampler(Noisy()))
    with pytest.raises(TypeError, match="know its position"):
        spotguard.DataLoader(Stream())
    with pytest.raises(ValueError, match="StatefulDataLoader"):
        spotguard.DataLoader(Stream(), num_workers=2)
    with pytest.raises(TypeError, match="spotguard.DataLoader"):
        spotguard.Run(tmp_path, loader=TorchLoader(Noisy()), daemon=False)


def test_loading_draws_nothing_from_the_global_generators_and_advances_the_sampler():
    loader = spotguard.DataLoader(Noisy(), batch_size=4, shuffle=True, seed=3)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    batches = [b for b in loader]
    assert torch.equal(before[0], torch.get_rng_state()) and random.getstate() == before[2]
    assert (np.random.get_state()[1] == before[1]).all()
    assert [len(b) for b in batches] == [4, 4, 2] and loader.sampler.position == 10
    with pytest.raises(SamplerStateError, match="remove the sampler.advance"):
        loader.sampler.advance(1)


def test_an_iterator_made_before_a_load_starts_at_the_loaded_position():
    def make():
        return spotguard.DataLoader(Noisy(), batch_size=3, shuffle=True, seed=1)

    whole = [b for b in make()]
    first = make()
    it = iter(first)
    next(it)
    saved = first.state_dict()
    resumed = make()
    early = iter(resumed)  # made before the checkpoint is loaded, as a loop often does
    resumed.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(list(early), whole[1:], strict=True))


def test_a_plain_torch_loader_over_a_resumable_sampler_warns_once_at_the_first_save():
    sampler = spotguard.ResumableSampler(10)
    for _ in TorchLoader(Noisy(), sampler=sampler, batch_size=5):
        sampler.advance(5)
    with pytest.warns(spotguard.NotExactWarning, match="spotguard.DataLoader"):
        sampler.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.state_dict()
    alone = spotguard.ResumableSampler(10)  # iterated by the user's own code: exact, no warning
    list(alone)
    alone.advance(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alone.state_dict()


class SelfTerminating(Dataset):
    """Each sample sends its worker SIGTERM (as a machine's shutdown does to every process)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        os.kill(os.getpid(), signal.SIGTERM)
        return torch.tensor([float(i), float(os.environ.get("SG_TEST_INIT", "-1"))])


def test_workers_survive_sigterm_and_the_users_worker_init_still_runs():
    def init(worker_id: int) -> None:
        os.environ["SG_TEST_INIT"] = str(worker_id)

    loader = spotguard.DataLoader(SelfTerminating(), batch_size=2, shuffle=False, num_workers=1,
                                  worker_init_fn=init)
    batches = list(loader)
    assert torch.cat(batches)[:, 0].sort().values.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert torch.cat(batches)[:, 1].tolist() == [0.0] * 4


ORPHAN_JOB = """
import os, sys, time
import torch
import spotguard

class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.tensor([float(i)])

def init(worker_id):
    with open(os.path.join(sys.argv[1], f"worker-{worker_id}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(1.0)  # the main process is SIGKILLed here, before torch's loop reads its parent pid

loader = spotguard.DataLoader(Items(), batch_size=4, shuffle=True, num_workers=2, worker_init_fn=init)
for batch in loader:
    time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_exit_when_the_main_process_is_killed_while_they_start(tmp_path):
    """torch's own orphan check reads the parent pid after the init functions: without spotguard's
    watch, workers orphaned during start-up would wait on their queue forever."""
    import subprocess
    import sys
    import time

    job = subprocess.Popen([sys.executable, "-c", ORPHAN_JOB, str(tmp_path)])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
            pids = [int(p.read_text()) for p in tmp_path.glob("worker-*") if p.read_text()]
        assert len(pids) == 2, "the workers did not start"
    finally:
        job.kill()
        job.wait(10)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = [pid for pid in pids if _alive(pid)]
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    assert not leaked, "workers outlived their SIGKILLed main process"


GROUP_JOB = """
import multiprocessing, os, signal, sys, threading, time
import torch
import spotguard

def main():
    os.setsid()  # as torchrun starts each rank: a session and process group of its own
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # threads: a forkserver on 3.11.7
    got = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: got.append(signum))
    data = torch.utils.data.TensorDataset(torch.arange(64.0).view(-1, 1))
    ours = spotguard.DataLoader(data, batch_size=4, shuffle=True, num_workers=2)
    def plain():
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=2,
                                           multiprocessing_context="fork",
                                           generator=torch.Generator().manual_seed(0))
    expected = [b[0].tolist() for b in plain()]
    guarded = spotguard.ignore_stop_signals(plain())
    drawn = {}
    for name, loader in (("ours", ours), ("plain", guarded)):
        it = iter(loader)
        drawn[name] = [next(it)[0].tolist() for _ in range(3)]
        for sig in (signal.SIGTERM, signal.SIGINT):  # the whole group: torchrun's killpg, Ctrl-C
            os.killpg(0, sig)
            time.sleep(0.2)
        drawn[name] += [b[0].tolist() for b in it]
    print("context", type(ours.multiprocessing_context).__name__ if ours.multiprocessing_context else "fork")
    print("batches", len(drawn["ours"]), len(drawn["plain"]), drawn["plain"] == expected)
    print("signals", sorted(set(got)) == sorted({signal.SIGTERM, signal.SIGINT}))
    if ours.multiprocessing_context is not None:  # another child of the forkserver: SIGTERM's default
        child = ours.multiprocessing_context.Process(target=time.sleep, args=(30,))
        child.start()
        time.sleep(0.5)
        child.terminate()
        child.join(10)
        print("child", child.exitcode)

if __name__ == "__main__":
    main()
"""


def test_workers_and_their_forkserver_outlive_sigterm_and_sigint_to_the_process_group(tmp_path):
    """torchrun's ``killpg`` (and Ctrl-C, ``scancel``) signals the rank's whole group. The workers of
    spotguard.DataLoader (started from a forkserver here: threads alive on 3.11.7) and of a plain
    torch loader passed to ``ignore_stop_signals`` (forked) go on, with the same batches; another
    child of the forkserver still dies of SIGTERM."""
    import subprocess
    import sys

    script = tmp_path / "group_job.py"
    script.write_text(GROUP_JOB)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["batches"] == "16 16 True" and lines["signals"] == "True", done.stdout
    if lines["context"] == "ForkServerContext":
        assert lines["child"] == str(-signal.SIGTERM), done.stdout


LOST_WHILE_STOPPING_JOB = """
import os, random, signal
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset
import spotguard
from spotguard.guard import Guard

class Noisy(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item() + np.random.rand() + random.random()])

def loader(persistent=False):
    return spotguard.DataLoader(Noisy(), batch_size=2, shuffle=True, num_workers=2, seed=3,
                                persistent_workers=persistent)

def batches(dl, kill_after=None):
    out = []
    for i, batch in enumerate(dl):
        out.append(batch.tolist())
        if i == kill_after:
            for pid in dl.worker_pids():
                os.kill(pid, signal.SIGKILL)
    return out

if __name__ == "__main__":
    expected = batches(loader())
    with pytest.raises((RuntimeError, EOFError, ConnectionError)):  # torch's, or the pipe's
        batches(loader(), kill_after=1)
    guard = Guard(daemon=False, force_exit=False)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.stop_requested
        assert batches(loader(), kill_after=1) == expected
        assert batches(loader(persistent=True), kill_after=3) == expected
    finally:
        guard.close()
    print("SAME BATCHES", flush=True)
"""


def test_workers_lost_while_stopping_start_again_at_the_same_batch(tmp_path):
    """Workers that die once the process is stopping (they were starting when torchrun's SIGTERM
    came, before they could ignore it) are started again at the same position: the loop gets the
    very batches an uninterrupted pass gives (persistent workers too), finishes its step and stops
    at the boundary. Without a stop pending, their death is an error as before. In a process of
    its own: torch's SIGCHLD handler raises for the killed workers wherever that process is."""
    script = tmp_path / "lost_while_stopping.py"
    script.write_text(LOST_WHILE_STOPPING_JOB)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0 and "SAME BATCHES" in done.stdout, done.stdout + done.stderr


LOST_LOADER_JOB = """
import hashlib, multiprocessing, os, signal, sys, time
import torch
import spotguard

def main():
    import faulthandler
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where, before the test's timeout
    os.setsid()  # its own group, as torchrun starts a rank
    ckpt, kill_at, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.arange(40.0).view(-1, 1))
    sampler = spotguard.ResumableSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=2,
                                         multiprocessing_context="fork", generator=torch.Generator())
    run = spotguard.Run(ckpt, model=model, optimizer=opt, sampler=sampler, daemon=False, save_every=1000)

    def batches():
        while True:
            yield from loader
            sampler.set_epoch(sampler.epoch + 1)

    it = batches()
    with run:
        for step in run.steps(total):
            if step == kill_at and run.start_step < kill_at:  # the stop, then the workers die (OOM-killed, say)
                os.killpg(0, signal.SIGTERM)
                for worker in multiprocessing.active_children():
                    os.kill(worker.pid, signal.SIGKILL)
                time.sleep(2)  # torch's SIGCHLD handler raises here: wherever the process is
            (x,) = next(it)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            sampler.advance(len(x))
    print("START", run.start_step)
    print("DIGEST", hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())

if __name__ == "__main__":
    main()
"""


def test_a_plain_loader_that_dies_of_the_stop_signal_saves_the_last_step_and_exits_75(tmp_path):
    """A SIGTERM to the group, then a plain torch loader's workers die (SIGKILLed: the stop signal
    itself no longer kills them, see test_worker_signals.py); torch's SIGCHLD handler raises inside
    the step. ``with run:`` saves the step finished last (its RNG and
    data position as at its end, as a stop between steps does) and exits 75, not a traceback."""
    import subprocess
    import sys

    from spotguard.checkpoint import Checkpointer

    script = tmp_path / "lost_loader.py"
    script.write_text(LOST_LOADER_JOB)
    stopped = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), "7", "16"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "the loader failed while stopping" in stopped.stderr and "Traceback" not in stopped.stderr
    assert "stopping at step 7: emergency save" in stopped.stderr, stopped.stderr[-3000:]
    assert Checkpointer(tmp_path / "ckpt").latest().step == 7
