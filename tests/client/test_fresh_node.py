"""The fresh-node case end to end: the identical command on a new node resumes from the durable store.

Without a daemon the store comes from ``$SPOTGUARD_STORAGE__URL``; beside a daemon, from its status.
"""

from __future__ import annotations

import shutil
import signal
import time

import pytest
from spotguard.protocol import StatusRequest
from spotguard.storage import Durable
from spotguard.storage.file import FileStore

from _example import Proc, final, isolated_env, run_to_end

pytestmark = pytest.mark.slow
ARGS = ("--save-every", "20")


def test_a_new_node_without_a_daemon_resumes_from_the_store(tmp_path):
    bucket, node1, node2 = tmp_path / "bucket", tmp_path / "node1", tmp_path / "node2"
    # the nodes' roots differ here, so the derived job ids would too: name the job
    env = isolated_env(tmp_path / "rt", SPOTGUARD_JOB_ID="default")
    reference = final(run_to_end(node1, 60, *ARGS, env=env))
    Durable(FileStore(bucket)).upload(node1 / "step-0000000040", "default")  # the old node's daemon
    shutil.rmtree(node1)  # the node is gone
    resumed = run_to_end(node2, 60, *ARGS, env={**env, "SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    assert "start step=40" in resumed.output
    assert final(resumed) == reference


def test_a_preempted_job_resumes_on_a_new_node_from_what_the_daemon_made_durable(tmp_path, daemon_factory):
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}"})
    env = isolated_env(daemon.runtime_dir)
    reference = final(run_to_end(tmp_path / "reference", 60, *ARGS, env=isolated_env(tmp_path / "rt")))
    ckpt = daemon.checkpoint_root / "job"
    job = Proc.example(ckpt, 60, *ARGS, "--step-sleep", "0.05", env=env)
    job.wait_line(r"checkpoint step=20")
    job.popen.send_signal(signal.SIGTERM)
    assert job.finish(30) == 75, job.output
    stopped = int(job.grab(r"stopped step=(\d+)")[0][1])
    durable = Durable(FileStore(bucket))
    deadline = time.monotonic() + 20
    job = None  # derived from the command line: the same on the new node
    while (job is None or durable.latest(job) != stopped) and time.monotonic() < deadline:
        job = next(iter(daemon.request(StatusRequest()).data["uploads"]["durable"]), None)
        time.sleep(0.05)
    assert job is not None and durable.latest(job) == stopped, daemon.output()
    shutil.rmtree(ckpt)  # a new node: nothing local, the daemon beside it knows the store
    resumed = run_to_end(ckpt, 60, *ARGS, "--step-sleep", "0.05", env=env)  # the identical command
    assert f"start step={stopped}" in resumed.output
    assert final(resumed) == reference


def test_a_newer_durable_checkpoint_not_loaded_is_an_error_and_a_record_event(tmp_path):
    """Issue 21.10: the store's step 40 cannot be restored (its object is no regular file: damaged),
    so the job trains from step 0: that is said as an error and recorded (``restore_failed``, with
    both steps), not a warning that scrolls by."""
    import json

    from spotguard.storage.durable import object_key

    bucket, node1, node2, record = tmp_path / "bucket", tmp_path / "node1", tmp_path / "node2", tmp_path / "rec"
    env = isolated_env(tmp_path / "rt", SPOTGUARD_JOB_ID="default")
    run_to_end(node1, 40, *ARGS, env=env)
    durable = Durable(FileStore(bucket))
    durable.upload(node1 / "step-0000000040", "default")
    for meta in durable.manifest("default", 40)["files"].values():
        (bucket / object_key(meta["sha256"])).unlink()
        (bucket / object_key(meta["sha256"])).mkdir()
    resumed = run_to_end(node2, 2, env={**env, "SPOTGUARD_STORAGE__URL": f"file://{bucket}",
                                          "SPOTGUARD_RECORD": str(record)})
    assert "start step=0" in resumed.output
    assert "holds step 40 of 'default', newer than every local checkpoint (none), and it was not restored" in resumed.output
    events = [json.loads(line) for line in record.read_text().splitlines()]
    failed = [e for e in events if e["event"] == "restore_failed"]
    assert len(failed) == 1 and failed[0]["store_step"] == 40 and failed[0]["local_step"] is None, failed
