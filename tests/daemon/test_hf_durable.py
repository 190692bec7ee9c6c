"""Hugging Face checkpoints become durable and restore on a fresh node.

The daemon uploads only committed ``step-NNNNNNNNNN`` directories (issue 12's rules); the HF
callback commits a copy of each ``checkpoint-N`` in that layout (``output_dir/spotguard``) and
reports the copy. End to end: the user-style HF job of ``tests/client/_integration_jobs.py`` runs
under node A's daemon with a ``file://`` store and is SIGKILLed at step 10; the identical command on
node B (empty output directory, a daemon of its own) restores step 8 from the store, reports its
restart from the tier ``bucket``, and ends bit-identical to an uninterrupted run. Hostile inputs: a
raw ``checkpoint-N`` commit is refused by the daemon with its reason, and a ``checkpoint-N`` holding
a symlink or FIFO is never copied or committed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from spotguard.integrations._hf_commit import NotCommitted, commit_copy, newest_committed
from spotguard.protocol import CommitRequest
from spotguard.storage._local import read_manifest, sha256_file
from spotguard.storage.durable import Durable
from spotguard.storage.file import FileStore

from test_goodput_fresh_node import node_b, wait_for  # noqa: F401 (a fixture)
from test_goodput_integrations import JOB as JOB_SCRIPT, launch, run_job
from test_goodput_metrics import tiers

pytest.importorskip("transformers", reason="needs transformers (extra: hf)")
from spotguard.integrations.huggingface import latest_checkpoint  # noqa: E402

JOB = "integration"  # the job id _integration_jobs.py gives the callback with a daemon


def trainer_checkpoint(where: Path) -> Path:
    """A stand-in for the Trainer's ``checkpoint-N``: its state file and a nested weights file."""
    (where / "sub").mkdir(parents=True)
    (where / "trainer_state.json").write_text('{"global_step": 8}')
    (where / "sub" / "model.safetensors").write_bytes(os.urandom(4096))
    return where


def test_a_copy_is_committed_in_spotguards_layout_and_the_two_newest_are_kept(tmp_path):
    root = tmp_path / "out" / "spotguard"
    (root / ".tmp-step-0000000002-999999999").mkdir(parents=True)  # a copy cut off by a kill
    for step in (4, 8, 12):
        src = trainer_checkpoint(tmp_path / "out" / f"checkpoint-{step}")
        copy = commit_copy(src, root, step, JOB)
        manifest = read_manifest(copy)
        assert (copy.name, manifest["step"], manifest["job_id"]) == (f"step-{step:010d}", step, JOB)
        for rel in ("trainer_state.json", "sub/model.safetensors"):
            assert manifest["files"][rel]["sha256"] == sha256_file(src / rel) == sha256_file(copy / rel)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000000008", "step-0000000012"]
    assert newest_committed(root, "trainer_state.json") == (12, root / "step-0000000012")


def test_latest_checkpoint_resumes_from_a_newer_committed_copy_and_prefers_the_trainers_on_a_tie(tmp_path):
    out = tmp_path / "out"
    commit_copy(trainer_checkpoint(tmp_path / "restored"), out / "spotguard", 12, JOB)
    trainer_checkpoint(out / "checkpoint-8")
    assert latest_checkpoint(out) == str(out / "spotguard" / "step-0000000012")
    trainer_checkpoint(out / "checkpoint-12")
    assert latest_checkpoint(out) == str(out / "checkpoint-12")


@pytest.mark.parametrize("hostile", ["symlink-out", "symlinked-dir", "fifo"])
def test_a_checkpoint_with_anything_but_regular_files_is_not_committed(tmp_path, hostile):
    src = trainer_checkpoint(tmp_path / "out" / "checkpoint-8")
    secret = tmp_path / "secret"
    secret.write_text("not the job's")
    if hostile == "symlink-out":
        (src / "optimizer.pt").symlink_to(secret)
    elif hostile == "symlinked-dir":
        (src / "rng").symlink_to(tmp_path, target_is_directory=True)
    else:
        os.mkfifo(src / "scaler.pt")
    root = tmp_path / "out" / "spotguard"
    with pytest.raises(NotCommitted, match="is not a regular file or directory"):
        commit_copy(src, root, 8, JOB)
    assert not root.exists()  # refused before anything was created


def test_the_daemon_refuses_a_raw_trainer_checkpoint_and_accepts_the_committed_copy(daemon_factory):
    daemon = daemon_factory()
    src = trainer_checkpoint(daemon.checkpoint_root / "hf" / "checkpoint-8")
    raw = daemon.request(CommitRequest(pid=os.getpid(), job_id=JOB, path=str(src), step=8))
    assert not raw.ok and "not a committed checkpoint directory (step-NNNNNNNNNN" in raw.error
    copy = commit_copy(src, src.parent / "spotguard", 8, JOB)
    accepted = daemon.request(CommitRequest(pid=os.getpid(), job_id=JOB, path=str(copy), step=8))
    assert accepted.ok, accepted.error
    assert "commit refused" in daemon.output()


def uninterrupted(out: Path) -> str:
    """The job's output run once, without a daemon or a store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    done = run_job("hf", out, {**env, "OMP_NUM_THREADS": "1", "SPOTGUARD_RUNTIME_DIR": f"{out}.rt"})
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


def digest(output: str) -> str:
    found = re.findall(r"^DIGEST (\w+)$", output, re.M)
    assert found, output[-3000:]
    return found[-1]


@pytest.mark.slow
@pytest.mark.timeout(300)  # three HF jobs: about 15 s each on an idle machine
def test_an_hf_job_restores_from_the_store_on_a_fresh_node_bit_identically(daemon_factory, node_b,  # noqa: F811
                                                                           tmp_path):
    bucket = tmp_path / "bucket"
    env = {"SPOTGUARD_STORAGE__URL": f"file://{bucket}"}
    node_a = daemon_factory(env=env)
    killed = launch("hf", node_a, node_a.checkpoint_root / "hf", JOB_KILL="10", **env)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    wait_for(lambda: Durable(FileStore(bucket)).latest(JOB) == 8, "step 8 durable")
    node_a.kill()  # the node is reclaimed with its disk
    fresh = node_b(env)
    out_b = fresh.checkpoint_root / "hf"
    again = launch("hf", fresh, out_b, **env)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "holds step 8: restoring it" in again.stdout
    assert tiers(fresh, "spotguard_job_restarts_total")["bucket"] == 1  # the callback said where step 8 came from
    assert digest(again.stdout) == digest(uninterrupted(tmp_path / "uninterrupted"))
    wait_for(lambda: Durable(FileStore(bucket)).latest(JOB) == 30, "node B's final save durable")
    assert "commit refused" not in node_a.output() + fresh.output()


@pytest.mark.slow
@pytest.mark.timeout(300)  # one two-rank HF job under torchrun
def test_every_ranks_rng_state_is_in_the_committed_copy_when_one_rank_writes_late(tmp_path):
    """The Trainer calls ``on_save`` on each rank as soon as that rank wrote its part, with no
    barrier: rank 0 must not copy ``checkpoint-N`` before rank 1's ``rng_state_1.pth`` is there
    (here rank 1's disk is 1.5 s slow), or the committed copy would resume rank 1 inexactly."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "JOB_"))}
    env.update(OMP_NUM_THREADS="1", SPOTGUARD_RUNTIME_DIR=str(tmp_path / "rt"), JOB_STEPS="8",
               JOB_SLOW_RNG_RANK="1", SPOTGUARD_STORAGE__URL=f"file://{tmp_path / 'bucket'}")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(JOB_SCRIPT), "hf", str(out)], env=env, timeout=240, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # DDP's find_unused_parameters warning fills the tail: leave it out, so a rank's own error shows
    # (CI once saw rank 0 end with SIGABRT here, and the tail held nothing else).
    shown = "\n".join(line for line in done.stdout.splitlines() if "reducer.cpp" not in line)
    assert done.returncode == 0, shown[-6000:]
    copies = sorted((out / "spotguard").glob("step-*"))
    assert [c.name for c in copies] == ["step-0000000004", "step-0000000008"], shown[-6000:]
    for copy in copies:
        files = read_manifest(copy)["files"]
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(files), (copy, sorted(files))
