"""What a user meets on the first day (issue 32, items 4-9), with real processes.

* One launch of ``examples/train_plain.py`` after another on one checkpoint root: the start line
  (fresh, then resumed and from where), a second launch on the held root refused with the holder's
  pid and host, Ctrl-C to the process group (a terminal's) saving the step reached and exiting 130
  with one line, Ctrl-C twice aborting at once, and ``$SPOTGUARD_FRESH=1`` starting over.
* Under torchrun two ranks of one job pass the lock, and a Ctrl-C to the group (which torchrun
  passes on to the ranks again) saves one step on both ranks, exit 130.
* The root's lock: a holder SIGKILLed leaves nothing that blocks; one process may take it twice.
* A fresh start is refused while the durable store holds the job's checkpoints.
* An unwritable root (a real read-only tmpfs mount) is refused at start with one line.
* The Hugging Face callback written as the docs show (no ``job_id``) derives its own id: a second
  command on the same store never restores the first one's model.

Lightning's fit on Ctrl-C: ``test_integrations.py``; ``spotguard run`` passing ``SPOTGUARD_FRESH``
to its first launch only: ``tests/daemon/test_run_supervisor.py``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard import _root
from spotguard.checkpoint import Checkpointer

from _example import Proc, isolated_env

ARGS = ("--save-every", "1000", "--step-sleep", "0.3")


def committed_step(ckpt: Path) -> int | None:
    info = Checkpointer(ckpt).latest()
    return None if info is None else info.step


def launch(ckpt: Path, env: dict[str, str], steps: int = 400) -> Proc:
    """The example in a process group of its own, as a terminal's foreground job."""
    return Proc.example(ckpt, steps, *ARGS, env=env, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_second_launch_is_refused_ctrl_c_saves_and_a_fresh_start_is_one_variable(tmp_path):
    env, ckpt = isolated_env(tmp_path / "rt"), tmp_path / "ckpt"
    first = launch(ckpt, env)
    try:
        first.wait_line(r"start step=0", timeout=60)
        assert re.search(r"^spotguard: job train_plain-[0-9a-f]{10}: fresh start at step 0 \(no checkpoint",
                         first.output, re.M), first.output

        second = launch(ckpt, env)  # the same command again while the first trains
        assert second.finish(60) == 1, second.output
        assert second.lines == [f"spotguard: the checkpoint root {ckpt} is in use by pid {first.popen.pid} "
                                f"on host {socket.gethostname()} (job {job_of(first)}, since "
                                f"{holder_since(ckpt)}): two launches on one root would interleave their "
                                "checkpoints. Wait for that run to end (or stop it), or give this launch "
                                "another checkpoint root"], second.output

        os.killpg(first.popen.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole group
        assert first.finish(150) == 130, first.output  # once over 60 s in CI, beside a 3-rank torchrun job
    finally:
        stop(first)
    (line,) = [x for x in first.lines if "Ctrl-C" in x]
    stopped = int(re.fullmatch(r"spotguard: interrupted \(Ctrl-C\): stopped at step (\d+), saved; the identical "
                               r"command resumes \(exit 130; Ctrl-C twice aborts at once\)", line)[1])
    assert stopped >= 1 and committed_step(ckpt) == stopped
    start = first.lines.index(next(x for x in first.lines if x.startswith("rank=0 pid=")))
    said = [x for x in first.lines[start + 1:] if not x.startswith(("checkpoint step=", "rank=0 stopped"))]
    assert said == [line], first.output  # Ctrl-C: one line

    again = launch(ckpt, env)  # the identical command resumes, and says so
    try:
        again.wait_line(rf"start step={stopped}", timeout=60)
        assert f"job {job_of(first)}: resumed from step {stopped} (local checkpoint {ckpt}/step-" in again.output
        os.killpg(again.popen.pid, signal.SIGINT)  # at its first step: 130 at once or at the next boundary
        assert again.finish(60) == 130, again.output
    finally:
        stop(again)
    assert len([x for x in again.lines if "interrupted (Ctrl-C)" in x]) == 1, again.output
    resumed = committed_step(ckpt)
    assert resumed in (stopped, stopped + 1), again.output

    # Starting over (a new command: 2 s steps), and Ctrl-C twice inside one step: abort at once.
    fresh = Proc.example(ckpt, 400, "--save-every", "1000", "--step-sleep", "2", env={**env, "SPOTGUARD_FRESH": "1"},
                         start_new_session=True)
    try:
        fresh.wait_line(r"start step=0", timeout=60)
        time.sleep(0.3)  # past the first optimizer step (a stop before it exits at once)
        os.killpg(fresh.popen.pid, signal.SIGINT)
        time.sleep(0.3)  # not sooner: two SIGINTs before the handler runs are one to Python
        os.killpg(fresh.popen.pid, signal.SIGINT)  # the second: abort now, not at the boundary
        assert fresh.finish(60) == -signal.SIGINT, fresh.output
    finally:
        stop(fresh)
    assert fresh.grab(rf"starting fresh: removed [12] checkpoint\(s\) under {re.escape(str(ckpt))} \(newest: "
                      rf"step {resumed}\)"), fresh.output
    assert "fresh start at step 0" in fresh.output and "KeyboardInterrupt" in fresh.output
    assert committed_step(ckpt) in (None, 1)  # the first Ctrl-C's save beside the step, if it was done

def job_of(proc: Proc) -> str:
    return re.search(r"spotguard: job (\S+):", proc.output)[1]


def holder_since(ckpt: Path) -> str:
    holder = (ckpt / _root.LOCK_NAME).read_text()
    assert len(holder.split(" ", 3)) == 4, f"the lock file holds {holder!r}"
    return holder.split(" ", 3)[3].strip()


def stop(proc: Proc) -> None:
    if proc.popen.poll() is None:
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.finish(30)


HOLDER = ("import sys, time; from pathlib import Path; from spotguard import _root; "
          "_root.hold(Path(sys.argv[1]), 'holder'); print('held', flush=True); time.sleep(60)")


def test_a_killed_holder_never_blocks_and_one_process_may_hold_a_root_twice(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(_root.StartRefused, match=rf"in use by pid {holder.pid} on host "
                                                     rf"{re.escape(socket.gethostname())} \(job holder, since "):
            _root.hold(tmp_path, "mine")
    finally:
        holder.kill()
        holder.wait()
    key = _root.hold(tmp_path, "mine")  # the kernel released the SIGKILLed holder's lock
    assert _root.hold(tmp_path, "mine") == key  # a second Run on the same root in this process
    _root.release(key)
    _root.release(key)
    assert key not in _root._held


@pytest.fixture
def read_only_mount(tmp_path):
    """A real read-only file system (tmpfs mounted ro), unmounted after the test."""
    where = tmp_path / "ro"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount(8) to make a read-only file system")
    yield where
    subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("inside", ["", "ckpt"])  # the mount itself (exists), or a root to create in it
def test_a_read_only_root_is_refused_at_start_with_one_line(read_only_mount, inside):
    import torch

    from spotguard import Run

    root = read_only_mount / inside if inside else read_only_mount
    with pytest.raises(SystemExit) as refused:
        Run(root, model=torch.nn.Linear(2, 1), daemon=False)
    assert refused.value.code == (f"spotguard: cannot write the checkpoint root {root}: Read-only file "
                                  "system (errno EROFS); give the run a directory it can write")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_hf_callback_without_a_job_id_never_restores_another_commands_model(tmp_path, monkeypatch):
    """Command 1 (the user-style HF job, no job_id, a file:// store) commits its copies under its
    derived id, uploaded as the daemon would; command 2 (this test's process, the same store)
    derives another id and starts from step 0; the store gives step 4 only to command 1's id."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (extra: hf)")
    from spotguard.integrations.huggingface import SpotguardTrainerCallback, latest_checkpoint
    from spotguard.storage._local import read_manifest
    from spotguard.storage.durable import Durable
    from spotguard.storage.file import FileStore

    from test_integrations import TinyModel, collate, dataset, quiet_guard

    bucket, out1 = tmp_path / "bucket", tmp_path / "out1"
    env = isolated_env(tmp_path / "rt", SPOTGUARD_STORAGE__URL=f"file://{bucket}", JOB_STEPS="4")
    job = Path(__file__).with_name("_integration_jobs.py")
    first = subprocess.run([sys.executable, str(job), "hf", str(out1)], env=env, timeout=180,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert first.returncode == 0, first.stdout[-3000:]
    copy = out1 / "spotguard" / "step-0000000004"
    first_id = read_manifest(copy)["job_id"]
    assert re.fullmatch(r"integration_jobs-[0-9a-f]{10}", first_id), first_id
    assert f"spotguard: job {first_id}: fresh start at step 0" in first.stdout
    Durable(FileStore(bucket)).upload(copy, first_id)  # what the daemon does with the reported copy

    monkeypatch.setenv("SPOTGUARD_STORAGE__URL", f"file://{bucket}")
    out2 = tmp_path / "out2"
    assert latest_checkpoint(out2) is None  # this command's id: nothing in the store
    callback = SpotguardTrainerCallback(guard=quiet_guard())
    args = transformers.TrainingArguments(str(out2), max_steps=2, per_device_train_batch_size=8, save_steps=1000,
                                          use_cpu=True, report_to=[], logging_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(TinyModel(), args, train_dataset=dataset(), data_collator=collate,
                                   callbacks=[callback])
    trainer.train(resume_from_checkpoint=latest_checkpoint(out2))
    callback.guard.close()
    assert callback.job_id not in ("", "default", first_id) and trainer.state.global_step == 2
    assert latest_checkpoint(tmp_path / "out3", job_id=first_id) == str(tmp_path / "out3" / "spotguard" /
                                                                        "step-0000000004")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_ranks_share_the_root_and_ctrl_c_to_the_group_saves_one_step_on_every_rank(tmp_path):
    """Two ranks of one job pass the root's lock; a terminal's Ctrl-C reaches torchrun and both
    ranks, and torchrun passes it on to the ranks again: that echo is not a second Ctrl-C."""
    env, ckpt = isolated_env(tmp_path / "rt", PYTHONWARNINGS="ignore"), tmp_path / "ckpt"
    from _example import example_args

    proc = Proc([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 *example_args(ckpt, 400, *ARGS)], env, start_new_session=True)
    try:
        for _ in range(2):
            proc.wait_line(r"rank=\d pid=\d+ start step=0", timeout=120)
        os.killpg(proc.popen.pid, signal.SIGINT)
        proc.finish(90)
    finally:
        stop(proc)
    stops = {int(m[1]): (int(m[2]), int(m[3])) for m in proc.grab(r"rank=(\d) stopped step=(\d+) status=(\d+)")}
    assert sorted(stops) == [0, 1] and len(set(stops.values())) == 1, proc.output
    (step, status), = set(stops.values())
    assert status == 130 and committed_step(ckpt) == step, proc.output
    assert len(proc.grab(r"spotguard: job \S+: fresh start")) == 1  # rank 0 only
    assert len(proc.grab(rf"interrupted \(Ctrl-C\): stopped at step {step}, saved")) == 1, proc.output
    assert "KeyboardInterrupt" not in proc.output


UNJOINED = """
import sys, time, torch, spotguard
model = torch.nn.Linear(4, 1)
with spotguard.Run(sys.argv[1], model=model, save_every=1000) as run:
    for step in run.steps(40):
        time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_ranks_that_never_joined_a_process_group_are_told_so_not_two_launches(tmp_path):
    """A single-process script launched by torchrun on two ranks (a mistake people make: the loop
    never calls init_process_group): both ranks say why, and the one refused the shared root
    says that, not "two launches on one root"."""
    script = tmp_path / "alone.py"
    script.write_text(UNJOINED)
    env = isolated_env(tmp_path / "rt", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", str(script), str(tmp_path / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=100, start_new_session=True)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    why = r"is rank [01] of 2 \(WORLD_SIZE=2, set by its launcher\), but torch.distributed is not initialised"
    assert len(re.findall(why, out)) == 2, out  # the lock's holder warns, the other is refused
    refused = re.findall(rf"spotguard: this process {why}.*Here they share the checkpoint root (\S+), and it "
                         "is taken", out)
    assert refused == [str(tmp_path / "ckpt")], out
    assert "two launches on one root" not in out


def test_a_fresh_start_is_refused_while_the_store_holds_the_jobs_checkpoints(tmp_path):
    import torch

    from spotguard import Run
    from spotguard.storage.durable import Durable
    from spotguard.storage.file import FileStore

    with Run(tmp_path / "old", model=torch.nn.Linear(2, 1), job_id="exp", save_every=2, daemon=False) as run:
        for _ in run.steps(2):
            pass
    Durable(FileStore(tmp_path / "bucket")).upload(tmp_path / "old" / "step-0000000002", "exp")
    run = Run(tmp_path / "new", model=torch.nn.Linear(2, 1), job_id="exp", daemon=False, fresh=True,
              durable=f"file://{tmp_path / 'bucket'}")
    with pytest.raises(SystemExit) as refused:
        next(run.steps(2))
    run.close()
    assert refused.value.code == (f"spotguard: starting fresh, but the store file://{tmp_path / 'bucket'} holds "
                                  "step 2 of job exp: give the new run its own job id (job_id= or "
                                  "$SPOTGUARD_JOB_ID), or resume instead (no fresh=True, no $SPOTGUARD_FRESH)")
