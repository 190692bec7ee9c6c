"""Clean stops under ``torchrun`` (gloo, CPU) for every way people train: ``spotguard.Run``, an
Accelerate loop, Lightning and the Hugging Face ``Trainer``, with the frameworks' own signal
handling in place (Lightning 2.6 installs a SIGTERM handler of its own).

Each cell runs ``_torchrun_jobs.py`` at 1, 2 or 3 ranks, stops it mid-run one way, and checks that
every rank exited 75 after one save at one agreed step, then relaunches the identical command and
checks that it ends on the uninterrupted run's final digest. The ways to stop:

* ``launcher``: SIGTERM to torchrun (what Kubernetes and ``docker stop`` do); it passes SIGTERM on
  to each worker's process group;
* ``workers``: SIGTERM to some of the workers only, in a random order (torchrun starts each worker
  in its own session, so a signal to the launcher's group does not reach them);
* ``notice``: a notice from a real daemon;
* ``kill``: SIGKILL to torchrun and every worker at once, after a periodic commit (a node lost
  without notice): nothing is checked of the stop, and the relaunch resumes from the last commit.

Each cell also picks bf16 autocast on or off, gradient accumulation over 1 or 2 micro-batches and
0 or 2 loader workers (see ``_torchrun_jobs.py``; torchrun's SIGTERM reaches the workers too); its
reference is the uninterrupted run of the same kind, ranks, autocast, accumulation and workers. The
full matrix is 4 x 3 x 4 x 2 x 2 x 2 cells of 20-60 s each on a loaded
2-core machine; each run samples :data:`SAMPLED` of them from a seed it prints
(``SPOTGUARD_MATRIX_SEED`` repeats a run's choice, ``SPOTGUARD_MATRIX_ALL=1`` runs every cell; see
``_matrix.py``).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _matrix import SEED, sample, skip_reason
from spotguard import _record
from spotguard.protocol import NotifyRequest

JOB = Path(__file__).with_name("_torchrun_jobs.py")
KINDS = ("run", "accelerate", "lightning", "hf")  # "loaders": its own test below
IMPORTS = {"accelerate": "accelerate", "lightning": "lightning.pytorch", "hf": "transformers"}
WAYS = ("launcher", "workers", "notice", "kill")
CELLS = [(kind, ranks, way, autocast, accum, workers) for kind in KINDS for ranks in (1, 2, 3) for way in WAYS
         for autocast in (0, 1) for accum in (1, 2) for workers in (0, 2)]

SAMPLED = 2  # the two tests below run every kind each time; the cells add ranks, ways, autocast, accumulation
CHOSEN = sample("torchrun", CELLS, SAMPLED)
STOP_LINE = re.compile(r"^\[rank (\d+)\] .*stopping at step (\d+)", re.M)
_references: dict[tuple[str, int], str] = {}


def job_env(out: Path, runtime: Path, **knobs: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    # 36 steps of at least 0.1 s: a signal by step 10 leaves more steps than Run's agreement
    # interval can span (its lag is capped at 2 s), so every stop falls inside the run.
    # PYTHONFAULTHANDLER: a rank that dies of a native abort (seen once in many runs, an [hf] rank's
    # SIGABRT) leaves every thread's Python stack in its log, which the failing assertion shows.
    env.update(knobs, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SPOTGUARD_RUNTIME_DIR=str(runtime),
               PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1", JOB_STEPS="36", JOB_STEP_SLEEP="0.1")
    return env


def torchrun(kind: str, ranks: int, out: Path, env: dict[str, str]) -> subprocess.Popen:
    """torchrun over the job, in a session of its own (its process group holds torchrun alone, as
    a container's init or a terminal's job would); its output goes to ``out.<n>.log`` (see
    :func:`output_of`)."""
    with open(out.with_name(f"{out.name}.{time.monotonic_ns()}.log"), "w") as log:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--max-restarts", "0", "--nproc-per-node", str(ranks), str(JOB), kind,
                                 str(out)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> None:
    """Wait for torchrun; past ``timeout`` kill it and each worker whose pid file is there."""
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            for pid_file in Path(proc.args[-1]).glob("pid.*"):
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            proc.kill()
            proc.wait(10)


def output_of(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(out.parent.glob(f"{out.name}.*.log")))


def exits(out: Path, ranks: int) -> dict[int, str]:
    return {r: (out / f"exit.{r}").read_text() if (out / f"exit.{r}").exists() else "missing"
            for r in range(ranks)}


def wait_progress(out: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the job ended ({proc.returncode}) before step {step}: {output_of(out)[-4000:]}"
        try:
            done = int((out / "progress").read_text() or 0)
        except (FileNotFoundError, ValueError):
            done = 0
        if done >= step:
            return done
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout} s: {output_of(out)[-4000:]}")


def launch_to_the_end(kind: str, ranks: int, out: Path, env: dict[str, str]) -> str:
    """Run the identical command (no signal) until it exits 0; return the final digest."""
    for exit_file in out.glob("exit.*"):
        exit_file.unlink()
    proc = torchrun(kind, ranks, out, env)
    finish(proc)
    text = output_of(out)
    assert proc.returncode == 0 and set(exits(out, ranks).values()) == {"0"}, \
        (proc.returncode, exits(out, ranks), text[-6000:])
    return re.findall(r"^DIGEST (\w+)$", text, re.M)[-1]


def reference(kind: str, ranks: int, tmp: Path, **knobs: str) -> str:
    key = (kind, ranks, *sorted(knobs.items()))
    if key not in _references:
        out = tmp / f"reference-{kind}-{ranks}"
        _references[key] = launch_to_the_end(kind, ranks, out, job_env(out, tmp / "rt-none", **knobs))
    return _references[key]


def last_start(out: Path) -> int:
    """The steps done at the first step end of the newest launch (see ``_torchrun_jobs.py``)."""
    return int((out / "starts").read_text().split()[-1])


def kill_all(proc: subprocess.Popen, out: Path) -> None:
    """SIGKILL the workers and torchrun at once: the node is gone, nobody saves."""
    for pid_file in out.glob("pid.*"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()


def checkpoint_steps(kind: str, out: Path) -> list[int]:
    pattern = "checkpoint-*" if kind == "hf" else "ckpt/step-*"
    return sorted(int(re.findall(r"\d+", p.name)[-1]) for p in out.glob(pattern))


def stop_and_resume(kind: str, ranks: int, way: str, tmp: Path, daemon_factory, rng: random.Random,
                    **knobs: str) -> None:
    """Stop the job one ``way`` mid-run, check the stop, resume it, compare with the reference."""
    expected = reference(kind, ranks, tmp, **knobs)
    out = tmp / f"stopped-{kind}-{ranks}-{way}"
    daemon = daemon_factory() if way == "notice" else None
    runtime = daemon.runtime_dir if daemon else tmp / "rt-none"
    env = job_env(out, runtime, **knobs, **({"JOB_DAEMON": "1"} if daemon else {}))
    proc = torchrun(kind, ranks, out, env)
    at = wait_progress(out, rng.randrange(2, 11), proc)
    if way == "kill":
        deadline = time.monotonic() + 120
        while not checkpoint_steps(kind, out):  # a commit to resume from, or the test proves nothing
            assert proc.poll() is None and time.monotonic() < deadline, output_of(out)[-4000:]
            time.sleep(0.02)
        kill_all(proc, out)
        finish(proc)
        saved = max(checkpoint_steps(kind, out))
        assert launch_to_the_end(kind, ranks, out, job_env(out, tmp / "rt-none", **knobs)) == expected
        assert last_start(out) >= saved, (saved, (out / "starts").read_text())
        return
    if way == "launcher":
        proc.send_signal(signal.SIGTERM)
    elif way == "workers":
        targets = rng.sample(range(ranks), rng.randrange(1, ranks + 1))
        for rank in targets:
            os.kill(int((out / f"pid.{rank}").read_text()), signal.SIGTERM)
            time.sleep(rng.random() * 0.1)
        print(f"SIGTERM to ranks {targets}")
    else:
        assert daemon.request(NotifyRequest(detail="torchrun matrix")).ok
    finish(proc)
    step = stopped(kind, ranks, out)
    assert step >= at
    assert launch_to_the_end(kind, ranks, out, job_env(out, tmp / "rt-none", **knobs)) == expected
    assert last_start(out) >= step, (step, (out / "starts").read_text())  # it resumed, not restarted


def stopped(kind: str, ranks: int, out: Path) -> int:
    """Check that every rank exited 75 after one save at one agreed step; return that step."""
    text = output_of(out)
    codes = exits(out, ranks)
    assert set(codes.values()) == {"75"}, (codes, text[-8000:])
    stops = {int(rank): int(step) for rank, step in STOP_LINE.findall(text)}
    assert sorted(stops) == list(range(ranks)) and len(set(stops.values())) == 1, (stops, text[-8000:])
    step = stops[0]
    assert step in checkpoint_steps(kind, out), (step, checkpoint_steps(kind, out))
    assert max(checkpoint_steps(kind, out)) == step  # nothing saved past the agreed step
    for bad in ("SIGTERMException", "forced exit 7", "Connection closed", "RuntimeError", "DistBackendError"):
        assert bad not in text, text[-8000:]
    launcher = text.count("SignalException: Process") + text.count("errors.ChildFailedError:")
    assert text.count("Traceback") == launcher, text[-8000:]  # torchrun's own: signalled, or workers exited 75
    return step


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind, ranks, way, autocast, accum, workers", CELLS,
                         ids=[f"{k}-{r}-{w}-autocast{a}-accum{n}-workers{p}" for k, r, w, a, n, p in CELLS])
def test_every_rank_stops_at_one_step_with_one_save_and_resumes_exactly(kind, ranks, way, autocast, accum,
                                                                        workers, tmp_path, daemon_factory):
    cell = (kind, ranks, way, autocast, accum, workers)
    if cell not in CHOSEN:
        pytest.skip(skip_reason())
    pytest.importorskip(IMPORTS.get(kind, "torch"))
    print(f"SPOTGUARD_MATRIX_SEED={SEED}")
    stop_and_resume(kind, ranks, way, tmp_path, daemon_factory, random.Random(f"{SEED}-{cell}"),
                    JOB_AUTOCAST=str(autocast), JOB_ACCUM=str(accum), JOB_WORKERS=str(workers))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["lightning", "hf"])
def test_framework_loaders_with_workers_outlive_sigterm_to_torchrun_and_resume_exactly(kind, tmp_path,
                                                                                      daemon_factory):
    """Lightning and the Hugging Face ``Trainer`` with 2 loader workers, their train loader and a
    validation loader every 5 steps (built by the user for Lightning, by the Trainer itself for
    evaluation: nothing of spotguard's on them), at 2 or 3 ranks (the seed picks): SIGTERM to
    torchrun alone at a random step stops every rank with 75 at one committed step, and the relaunch
    ends bit-identical to an uninterrupted run."""
    pytest.importorskip(IMPORTS[kind])
    rng = random.Random(f"{SEED}-{kind}-workers")
    ranks = rng.choice((2, 3))
    print(f"SPOTGUARD_MATRIX_SEED={SEED} ranks={ranks}")
    stop_and_resume(kind, ranks, "launcher", tmp_path, daemon_factory, rng, JOB_WORKERS="2", JOB_VALIDATE="5")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["accelerate", "hf"])
def test_one_signalled_rank_stops_both_at_the_next_boundary_and_the_job_resumes_exactly(kind, tmp_path):
    """Rank 1 alone sends itself SIGTERM once 5 steps are done. The Accelerate loop (prepared
    model, optimizer and scheduler given to ``Run``) and the Hugging Face ``Trainer`` stop on both
    ranks; the ``Trainer`` at the very next step end (6), and each resumes bit-identically."""
    pytest.importorskip(IMPORTS[kind])
    expected = reference(kind, 2, tmp_path)
    out = tmp_path / f"signalled-{kind}"
    proc = torchrun(kind, 2, out, job_env(out, tmp_path / "rt-none", JOB_SIGNAL_AT="5", JOB_SIGNAL_RANK="1"))
    finish(proc)
    step = stopped(kind, 2, out)
    # Run acts at the boundary after step 5 when the notice is flagged by then, else at 6
    assert step == 6 if kind == "hf" else step >= 5
    assert launch_to_the_end(kind, 2, out, job_env(out, tmp_path / "rt-none")) == expected


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["run", "lightning", "hf"])
def test_a_lost_peer_ends_the_other_rank_with_77(kind, tmp_path):
    """Rank 1 is SIGKILLed mid-run (its node gone): rank 0's next collective (DDP's backward or the
    ranks' exchange) fails, and rank 0 ends with 77 and a ``peer_lost`` record, not with 1 and a
    traceback as a crash."""
    pytest.importorskip(IMPORTS.get(kind, "torch"))
    out, record = tmp_path / f"lost-{kind}", tmp_path / f"{kind}.record"
    proc = torchrun(kind, 2, out, job_env(out, tmp_path / "rt-none", SPOTGUARD_RECORD=str(record)))
    wait_progress(out, 4, proc)
    os.kill(int((out / "pid.1").read_text()), signal.SIGKILL)
    finish(proc)
    lost = [e for e in _record.read(record) if e["event"] == "peer_lost"]
    assert [e["rank"] for e in lost] == [0], (lost, output_of(out)[-6000:])
    assert "exiting 77" in output_of(out)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_loader_workers_outlive_sigterm_to_torchrun_and_to_the_whole_job(tmp_path):
    """3 ranks, each step on a batch of a ``spotguard.DataLoader`` and one of a plain torch
    ``DataLoader`` (nothing of spotguard's on it), 2 workers each, started again every epoch. torchrun
    passes SIGTERM on with ``killpg`` to each rank's group, workers included: the workers go on, and
    every rank exits 75 at one agreed step, committed. First SIGTERM to torchrun alone (Kubernetes) at
    a random step, then, right after the resume, to every process group of the job at once (a
    terminal, ``scancel``); the last launch resumes each time at the stop step (0 steps redone) and
    ends bit-identical to an uninterrupted run."""
    rng = random.Random(f"{SEED}-loaders")
    print(f"SPOTGUARD_MATRIX_SEED={SEED}")
    knobs = {"JOB_WORKERS": "2"}
    expected = reference("loaders", 3, tmp_path, **knobs)
    out = tmp_path / "stopped-loaders"
    env = job_env(out, tmp_path / "rt-none", **knobs)
    proc = torchrun("loaders", 3, out, env)
    wait_progress(out, rng.randrange(2, 11), proc)
    proc.send_signal(signal.SIGTERM)
    finish(proc)
    first = stopped("loaders", 3, out)
    for stale in [*out.glob("exit.*"), out / "progress"]:  # the first launch's: a relaunch writes its own
        stale.unlink()
    proc = torchrun("loaders", 3, out, env)
    wait_progress(out, first + 1, proc)
    assert last_start(out) == first + 1  # resumed at the stop step: nothing redone
    groups = [proc.pid] + [int((out / f"pid.{rank}").read_text()) for rank in range(3)]
    for group in groups:  # each rank leads its own session (torchrun's start_new_session)
        os.killpg(group, signal.SIGTERM)
    finish(proc)
    second = stopped("loaders", 3, out)
    assert launch_to_the_end("loaders", 3, out, env) == expected
    assert last_start(out) == second + 1
