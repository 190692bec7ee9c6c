"""Issue 28 item 2: node 0 proposes the step the other nodes upload next (upload_fleet), with a real
file store and real committed node-local checkpoints; the queue test is in test_upload_long_run.py."""

from __future__ import annotations

import json
import logging
import shutil
import time

from spotguard.checkpoint.commit import apply_retention
from spotguard.storage.durable import Durable, manifest_key
from spotguard.storage.file import FileStore

from conftest import write_checkpoint
from test_upload_long_run import node_ckpt
from test_upload_queue import _queue
from spotguard_daemon.core import upload_fleet
from spotguard_daemon.core.upload_fleet import Fleet, next_key, read_next


def _node(tmp_path, index: int, steps) -> tuple[Fleet, list]:
    fleet = Fleet(lag_bound=60.0)
    paths = [node_ckpt(tmp_path / f"ckpt{index}", s, index, {"w.bin": bytes([s])}) for s in steps]
    fleet.learn("job", paths[-1])
    return fleet, paths


def _global(durable: Durable, step: int) -> None:
    durable.store.put_bytes(manifest_key("job", step), b"{}")
    durable.store.put_bytes("jobs/job/latest", f"step-{step:010d}\n".encode())


def test_node_0_proposes_one_step_at_a_time_and_the_others_follow_it(tmp_path):
    durable = Durable(FileStore(tmp_path / "bucket"))
    leader, mine = _node(tmp_path, 0, [5, 9])
    follower, paths = _node(tmp_path, 1, [5, 7, 9])
    assert follower.follows("job") and not leader.follows("job")
    leader.uploaded(durable, "job", 5, str(mine[0]), complete=True, seconds=0.1)  # global already: nothing to propose
    assert read_next(durable.store, "job") is None
    leader.uploaded(durable, "job", 5, str(mine[0]), complete=False, seconds=0.1)
    assert read_next(durable.store, "job")[0] == 5
    leader.uploaded(durable, "job", 9, str(mine[1]), complete=False, seconds=0.1)  # 5 is open: the others are completing it
    assert read_next(durable.store, "job")[0] == 5

    assert follower.target(durable.store, "job", 9, str(paths[-1]), global_step=-1) == 5
    assert follower.finishes("job", 5) and not follower.finishes("job", 9)
    follower.uploaded(durable, "job", 5, str(paths[0]), complete=True, seconds=0.1)
    assert follower.target(durable.store, "job", 9, str(paths[-1]), global_step=-1) is None  # sent already
    assert follower.target(durable.store, "job", 5, str(paths[0]), global_step=5) is None  # global: done

    _global(durable, 5)
    leader.uploaded(durable, "job", 9, str(mine[1]), complete=False, seconds=0.1)  # 5 is global: 9 is next
    assert read_next(durable.store, "job")[0] == 9
    assert follower.target(durable.store, "job", 9, str(paths[-1]), global_step=5) is None
    assert follower.finishes("job", 9)  # the upload in flight is the proposed one: finished


def test_a_stale_proposal_is_replaced_and_one_not_held_locally_is_skipped(tmp_path, caplog):
    durable = Durable(FileStore(tmp_path / "bucket"))
    leader, mine = _node(tmp_path, 0, [3, 7, 8])
    follower, paths = _node(tmp_path, 1, [7])
    durable.store.put_bytes(next_key("job"), b'{"step": 3, "proposed": %f}' % (time.time() - 61))
    assert follower.target(durable.store, "job", 7, str(paths[-1]), global_step=-1) is None  # 3 is gone here
    assert not follower.finishes("job", 3)
    leader.uploaded(durable, "job", 7, str(mine[1]), complete=False, seconds=0.1)  # 3 open for longer than the bound: replaced
    assert read_next(durable.store, "job")[0] == 7
    for junk in (b"[", b'{"step": true, "proposed": 1}', b'{"step": 1, "proposed": NaN}', b"x" * 300):
        durable.store.put_bytes(next_key("job"), junk)
        assert follower.target(durable.store, "job", 7, str(paths[-1]), global_step=-1) is None
        leader.uploaded(durable, "job", 8, str(mine[2]), complete=False, seconds=0.1)  # junk is replaced by node 0's proposal
        assert read_next(durable.store, "job")[0] == 8
    assert "not what node 0 writes" in caplog.text
    one = Fleet(lag_bound=60.0)  # a job on one node (no node section) never reads next.json
    one.learn("job", write_checkpoint(tmp_path / "single", 1, {"w.bin": b"w"}))
    assert not one.follows("job")
    assert one.target(durable.store, "job", 7, str(paths[-1]), global_step=-1) is None


def test_a_proposal_no_node_can_finish_any_more_is_replaced_before_the_bound(tmp_path, monkeypatch):
    """The nodes keep alike: once node 0's retention deleted the proposed step, the others' did too,
    unless they took it already; those finish it within SLOWER times node 0's own upload of it.
    After that, node 0 proposes the step it starts next, not 10 minutes later."""
    monkeypatch.setattr(upload_fleet, "SLOWER_SLACK", 0.0)
    durable = Durable(FileStore(tmp_path / "bucket"))
    leader, mine = _node(tmp_path, 0, [4, 11])
    assert leader.propose(durable, "job", 4, str(mine[0]), "node 0 finishes its part as the others will")
    leader.uploaded(durable, "job", 4, str(mine[0]), complete=False, seconds=0.2)  # its part, in 0.2 s
    leader.uploaded(durable, "job", 11, str(mine[1]), complete=False, seconds=0.2)  # a later one, not proposed
    assert read_next(durable.store, "job")[0] == 4
    shutil.rmtree(mine[0])  # the job's retention (keep) deleted it
    assert not leader.propose(durable, "job", 11, str(mine[1]), "-")  # the others may still send theirs
    assert read_next(durable.store, "job")[0] == 4
    time.sleep((upload_fleet.SLOWER - 1) * 0.2 + 0.1)
    assert leader.propose(durable, "job", 11, str(mine[1]), "node 0 finishes its part as the others will")
    assert read_next(durable.store, "job")[0] == 11
    shutil.rmtree(mine[1])  # its part of a step uploaded after the job deleted the step: not proposed
    leader.uploaded(durable, "job", 12, str(mine[1].parent / "step-0000000012"), complete=False, seconds=0.1)
    assert read_next(durable.store, "job")[0] == 11


def test_a_follower_finishes_a_superseded_upload_once_node_0_proposed_its_step(tmp_path, caplog):
    """Node 0 proposes a step as it starts the upload it will finish; a follower whose upload of that
    step is superseded meanwhile (its job's retention may delete it next) goes on with it."""
    caplog.set_level(logging.INFO, logger="spotguard_daemon.core.upload_fleet")
    durable = Durable(FileStore(tmp_path / "bucket"))
    leader, mine = _node(tmp_path, 0, [4])
    follower, _ = _node(tmp_path, 1, [4, 5])
    assert not follower.adopt(durable.store, "job", 4, global_step=-1)  # nothing proposed: superseded
    leader.propose(durable, "job", 4, str(mine[0]), "node 0 finishes its part")
    assert not leader.adopt(durable.store, "job", 4, global_step=-1)  # node 0 decides for itself
    assert not follower.adopt(durable.store, "job", 5, global_step=-1)  # not the proposed step
    assert not follower.adopt(durable.store, "job", 4, global_step=4)  # global already
    assert follower.adopt(durable.store, "job", 4, global_step=-1) and follower.finishes("job", 4)
    assert "finishing the upload of job step 4 although a newer checkpoint is committed: node 0 proposed it" in caplog.text


def test_a_step_proposed_ahead_is_held_from_its_commit_and_uploaded_after_the_job_deleted_it(tmp_path, caplog):
    """Node 0 proposed the commit at or after step 10 before this node committed it (its uploads
    start late: :meth:`Fleet.threshold`); this node reads it before its first upload (step 7) goes
    out. It holds step 10 open as the commit is reported
    and uploads its part although the job's retention (``keep=1``) deleted the step before that
    upload began, while the upload of step 8 was still in flight. Before, a follower could take a
    proposed step only while its job still kept it, and on a loaded machine missed most."""
    caplog.set_level(logging.INFO, logger="spotguard_daemon")
    store = FileStore(tmp_path / "bucket")
    store.put_bytes(next_key("job"), json.dumps({"step": 10, "proposed": time.time()}).encode())
    queue, done, _ = _queue(store, tmp_path / "n1", bandwidth_mbps=0.5)  # 200 kB a step: 0.4 s
    queue.durable.replicated_wait = 0.2  # node 0's part never comes here
    root = tmp_path / "ckpt1"
    queue.start()
    try:
        queue.submit("job", node_ckpt(root, 7, 1, {"w.bin": b"7"}), 7)  # the daemon learns its node index
        assert queue.wait_idle(10)
        assert "the commit at or after step 10 is the proposed one" in caplog.text  # read before 7 went
        queue.submit("job", node_ckpt(root, 8, 1, {"w.bin": bytes([8]) * 2_000_000}), 8)  # 4 s to send
        deadline = time.monotonic() + 10
        while (queue.status()["uploading"] or {}).get("step") != 8:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.01)
        time.sleep(0.5)  # its files open (its bytes are paced: 4 s), before the job's retention runs
        for step in (9, 10, 11, 12):
            ckpt = node_ckpt(root, step, 1, {"w.bin": bytes([step]) * 200_000})
            queue.submit("job", ckpt, step)
            apply_retention(root, 1, ckpt)  # the job's own, right after each commit
        assert not (root / "step-0000000010").exists()
        assert queue.wait_idle(30)
    finally:
        queue.close()
    assert [s for _, s in done] == [7, 10, 12], caplog.text  # 8, 9 and 11 superseded; 10 finished
    assert queue.pins.get("job") is None  # let go once uploaded
    assert "the job deleted it" not in caplog.text


def test_node_0_proposes_its_step_when_on_time_and_a_commit_ahead_when_late(tmp_path):
    """:meth:`Fleet.threshold`: the step node 0 starts uploading, while it starts within a quarter
    of a save interval of that step's commit; later, the first commit at or after a step some
    saves ahead (each node resolves it to the same commit: :meth:`Fleet.resolve`), whose commit
    each node awaits to hold it (:meth:`Fleet.expect`, :meth:`Fleet.submitted`)."""
    fleet = Fleet(lag_bound=60.0)
    for step in (10, 20, 30):  # a save every 0.1 s, every 10 steps
        assert not fleet.submitted("job", step)
        time.sleep(0.1)
    assert fleet.threshold("job", 30) > 30  # 0.1 s late: a commit ahead
    assert not fleet.submitted("job", 40)
    assert fleet.threshold("job", 40) == 40  # at once: its own step
    time.sleep(0.1)
    ahead = fleet.threshold("job", 40)
    assert ahead > 41 and (ahead - 41) % 10 == 0 and fleet.resolve("job", ahead) is None
    assert [fleet.resolve("job", t) for t in (5, 20, 25, 40)] == [5, 20, 30, 40]  # older than seen: itself
    fleet.expect("job", 45)
    assert fleet.submitted("job", 50)  # the first commit at or after 45: held from its commit
    assert not fleet.submitted("job", 50) and not fleet.submitted("job", 60)  # once
    assert fleet.resolve("job", 45) == 50


def test_a_followers_first_upload_takes_the_step_node_0_proposed(tmp_path, caplog):
    """A daemon (re)started on node 1 learns that node 0 leads the job from the first checkpoint it
    stages; before anything is sent it chooses again, as a follower: node 0's proposed step 5, still
    held here, goes first, then the newest commit. Before, that first upload sent step 7 alone, and
    step 5 waited in vain for node 1's part."""
    caplog.set_level(logging.INFO, logger="spotguard_daemon")
    store = FileStore(tmp_path / "bucket")
    store.put_bytes(next_key("job"), json.dumps({"step": 5, "proposed": time.time()}).encode())
    queue, done, _ = _queue(store, tmp_path / "n1")
    queue.durable.replicated_wait = 0.2  # node 0's part never comes here
    root = tmp_path / "ckpt1"
    node_ckpt(root, 5, 1, {"w.bin": b"5"})
    queue.start()
    try:
        queue.submit("job", node_ckpt(root, 7, 1, {"w.bin": b"7"}), 7)
        assert queue.wait_idle(10)
    finally:
        queue.close()
    assert [s for _, s in done] == [5, 7], caplog.text
    assert "uploading job step 5 before step 7: node 0's part of it is in the store" in caplog.text
