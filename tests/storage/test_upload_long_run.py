"""Issue 28: the upload queue in a long run (real stores, the real queue, no daemon process)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard.checkpoint.commit import apply_retention
from spotguard.storage.durable import Durable
from spotguard.storage.base import StoreOptions
from spotguard.storage.file import FileStore
from spotguard.storage.registry import open_store

from conftest import write_checkpoint
from storage_proxy import Proxy
from test_upload_queue import _queue
from spotguard_daemon.core import upload_global
from spotguard_daemon.core.upload_retention import Retention


def test_every_rank_reporting_the_same_commit_makes_one_upload(tmp_path, make_ckpt, caplog):
    """Item 6: the ranks of a node each report the node's commit; it is uploaded once, never
    abandoned as "superseded" by itself, and a late report of an older step changes nothing."""
    store = FileStore(tmp_path / "bucket")
    files = {f"t{i}.bin": bytes([i]) * 500_000 for i in range(4)}  # 2 MB at 4 MB/s: about 0.5 s
    queue, done, _ = _queue(store, tmp_path, bandwidth_mbps=4)
    old = make_ckpt(tmp_path / "ckpt", 1, {"a": b"a"})
    ckpt = make_ckpt(tmp_path / "ckpt", 2, files)
    queue.start()
    caplog.set_level(logging.INFO, logger="spotguard_daemon")
    try:
        queue.submit("job", ckpt, 2)
        deadline = time.monotonic() + 10
        while (queue.status()["uploading"] or {}).get("step") != 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(2):  # rank 1 and rank 2 of the node
            queue.submit("job", ckpt, 2)
        queue.submit("job", old, 1)  # a rank's report of the previous step, late
        assert queue.status()["pending"] == []
        assert queue.wait_idle(30)
    finally:
        queue.close()
    assert done == [("job", 2)]
    assert "superseded" not in caplog.text
    assert caplog.text.count("queued job step 2 for upload") == 1
    assert Durable(store).list("job") == [2]


class SlowObjectPuts(Proxy):
    """A throttled store: every object PUT waits ``slow_s`` before it is forwarded."""

    def pick_fault(self, method: str, path: str) -> str | None:
        return "slow" if method == "PUT" and "/objects/" in path else None


def node_ckpt(root, step: int, index: int, files: dict[str, bytes], nodes: int = 2, digest: str = "a") -> object:
    """A committed node-local checkpoint of node ``index`` (rank ``index``) the way a leader commits one."""
    node = {"index": index, "nodes": nodes, "leader": index, "ranks": [index], "digests": [digest * 64] * nodes}
    return write_checkpoint(root, step, {f"rank-{index}/{k}": v for k, v in files.items()}, node=node,
                            world_size=nodes, digest=digest * 64)


def test_slow_nodes_converge_on_one_step_that_becomes_global_while_saving(moto, new_bucket, tmp_path):
    """Item 2: both nodes' stores are throttled, at different speeds (~0.6 s and ~0.9 s per checkpoint),
    and the job saves every 0.2 s. Before, each node finished whichever upload its own count of
    supersedes picked, so the nodes could finish different steps and none became global; now node 0
    finishes one (``max_superseded``) and proposes it, node 1 uploads that step next and finishes it,
    so a step becomes global while the job saves, whatever the load.

    The job's own retention runs after each commit, as the Checkpointer's does (the default
    ``keep=3``). Before node 0 proposed a step as it started its upload, node 1's retention deleted
    the step long before node 0's part was in the store, and no step became global in 60 saves."""
    keep = 3
    direct = new_bucket("s3")
    with SlowObjectPuts(moto.url, slow_s=0.2) as slow_a, SlowObjectPuts(moto.url, slow_s=0.3) as slow_b:
        stores = [open_store(direct.url, StoreOptions(endpoint_url=p.url, max_attempts=6)) for p in (slow_a, slow_b)]
        (a, done_a, _), (b, done_b, _) = (_queue(store, tmp_path / f"n{k}") for k, store in enumerate(stores))
        a.durable.concurrency = b.durable.concurrency = 1
        pruned = {a: [], b: []}  # retention of a node-local job is node 0's alone (one prune per step)
        for queue in (a, b):
            queue.retention = Retention(lambda job, queue=queue: pruned[queue].append(job), 5.0)
        a.start(), b.start()
        global_while_saving, lags = None, []
        try:
            for step in range(1, 61):  # saving until 2 saves after the first global step (about 16)
                if global_while_saving is not None and step > global_while_saving + 2:
                    break
                last = step
                for k, queue in enumerate((a, b)):
                    files = {f"f{i}.bin": os.urandom(20_000) for i in range(3)}
                    ckpt = node_ckpt(tmp_path / f"ckpt{k}", step, k, files)
                    queue.submit("job", ckpt, step)
                    apply_retention(tmp_path / f"ckpt{k}", keep, ckpt)  # the job's, after its commit
                time.sleep(0.2)
                lags.append(b.watch.lag())
                if global_while_saving is None and Durable(direct).latest("job") is not None:
                    global_while_saving = step
            saved = time.monotonic()
            assert a.wait_idle(60) and b.wait_idle(60)
            print(f"idle {time.monotonic() - saved:.1f} s after the last save")
        finally:
            a.close(), b.close()
    assert global_while_saving is not None, f"no step became global while the job saved; a: {done_a}, b: {done_b}"
    proposed = [s for _, s in done_a if s in {s for _, s in done_b}]
    assert Durable(direct).list("job")[0] == proposed[0] < last, (done_a, done_b)  # a step both finished
    assert Durable(direct).latest("job") == last  # the last one is never superseded
    assert max(lags) > 0 and b.watch.lag() == 0  # the gauge: behind while saving, 0 once global
    assert len(pruned[a]) == len(done_a) and pruned[b] == []
    print(f"first global step while saving: after the commit of step {global_while_saving}; a: {done_a}, b: {done_b}")


class LaggingList(FileStore):
    """A store whose listing lags (some S3-compatible gateways, caches): a key shows up in ``list``
    only ``lag`` seconds after it was written; reads and ``exists`` see it at once."""

    def __init__(self, root, lag: float) -> None:
        super().__init__(root)
        self.lag = lag

    def list(self, prefix: str):
        now = time.time()
        return [key for key in super().list(prefix) if now - self._path(key).stat().st_mtime >= self.lag]


def test_a_store_whose_listing_lags_still_makes_the_step_global(tmp_path, monkeypatch):
    """Item 4: both nodes' parts land while the listing shows neither the other's part; before,
    nothing ever wrote the global manifest. The daemon checks the incomplete step again until it is."""
    monkeypatch.setattr(upload_global, "RECHECK_FIRST", 0.5)
    queues = [_queue(LaggingList(tmp_path / "bucket", lag=1.0), tmp_path / f"n{k}")[0] for k in (0, 1)]
    for k, queue in enumerate(queues):
        queue.start()
        queue.submit("job", node_ckpt(tmp_path / f"ckpt{k}", 10, k, {"w.bin": bytes([k]) * 1000}), 10)
    try:
        assert all(queue.wait_idle(30) for queue in queues)
        assert Durable(FileStore(tmp_path / "bucket")).latest("job") is None  # no upload saw both parts
        deadline = time.monotonic() + 15
        while Durable(FileStore(tmp_path / "bucket")).latest("job") != 10:
            assert time.monotonic() < deadline, queues[0].status()["global"]
            time.sleep(0.1)
        while not all(q.status()["global"]["job"]["global_step"] == 10 for q in queues):
            assert time.monotonic() < deadline, [q.status()["global"] for q in queues]
            time.sleep(0.1)
    finally:
        for queue in queues:
            queue.close()
    assert all(q.watch.lag() == 0 and q.status()["global"]["job"]["recheck_step"] is None for q in queues)


def test_the_cadence_never_plans_saves_faster_than_the_store_takes_them(tmp_path, make_ckpt):
    """Item 2: the daemon measures the time from commit to durable (here ~0.5 s: 2 MB at 4 MB/s),
    and a cadence whose Young/Daly interval is shorter plans with that instead."""
    from spotguard.cadence import Cadence
    from spotguard.guard import _seconds

    queue, _, _ = _queue(FileStore(tmp_path / "bucket"), tmp_path, bandwidth_mbps=4)
    assert queue.time_to_durable("job") is None
    queue.start()
    try:
        queue.submit("job", make_ckpt(tmp_path / "ckpt", 1, {"w.bin": os.urandom(2_000_000)}), 1)
        assert queue.wait_idle(30)
    finally:
        queue.close()
    took = queue.time_to_durable("job")
    assert 0.3 < took < 10, took
    assert [_seconds(v) for v in (took, None, True, float("nan"), -1, 2e6)] == [took, None, None, None, None, None]
    cadence = Cadence(mtbf_s=10.0, cost_s=0.001)  # Daly: ~0.14 s between saves
    cadence.observe_step(0.01)
    assert cadence.interval_s < took and cadence.steps == int(cadence.interval_s / 0.01)
    cadence.floor(took)
    assert cadence.interval_s == took and cadence.steps == int(took / 0.01)
    cadence.floor(0.001)  # a store that became fast: the plan is Daly's again
    assert cadence.interval_s == pytest.approx(0.1414, rel=0.05)
    fixed = Cadence(every_seconds=0.05)
    fixed.floor(took)
    assert fixed.interval_s == 0.05  # a fixed interval is the user's to choose


def test_three_nodes_behind_their_saves_make_a_step_global_again_and_again(moto, new_bucket, tmp_path):
    """Three nodes uploading at three speeds (~0.4, 0.6 and 0.8 s a checkpoint: six objects each),
    all slower than the job's saves (every 0.2 s), each with the job's own retention (``keep`` 1-3,
    sampled). Node 0 proposes the step it starts uploading and finishes it; the others take it at
    their next upload or finish the one in flight (abandoning a wait for node 0's part within
    50 ms of a newer commit), so every node finishes the same steps, one after another. Before: no
    step became global in 60 saves, whatever ``keep``.

    Each node (its job's saves and its daemon's queue) runs in a process of its own
    (``_fleet_node.py``), as on real nodes: with the three queues in the test's process, their
    requests waited for each other's interpreter lock, an upload took 10-20 s on a loaded machine,
    and node 0's proposal came after the others' retention had deleted the step."""
    seed = random.randrange(1 << 16)
    keep = random.Random(seed).choice([1, 2, 3])
    print(f"seed {seed}: keep={keep}")
    direct = new_bucket("s3")
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(SlowObjectPuts(moto.url, slow_s=s)) for s in (0.06, 0.09, 0.12)]
        nodes = [FleetNode(direct.url, p.url, tmp_path / f"n{k}", k, 3, keep) for k, p in enumerate(proxies)]
        for node in nodes:
            stack.callback(node.stop)
        seen: list[int] = []  # the global steps, as they came while the job saved
        step, deadline = 0, time.monotonic() + SAVING_S
        while len(seen) < 3 and time.monotonic() < deadline:
            step += 1
            for node in nodes:  # every node commits the step, as a job's ranks do
                node.send({"save": step})
            for node in nodes:
                assert node.receive() == {"saved": step}
            time.sleep(0.2)
            latest = Durable(direct).latest("job")
            if latest is not None and latest not in seen:
                seen.append(latest)
        ends = [node.close() for node in nodes]
    assert all(end["idle"] for end in ends), ends
    finished = [set(end["done"]) for end in ends]
    print(f"global steps while saving: {seen} (saved up to {step}); finished per node: {finished}")
    assert len(seen) == 3, f"global steps while saving: {seen} in {step} saves; finished per node: {finished}"
    assert all(g in f for g in seen for f in finished)
    assert Durable(direct).latest("job") == step  # the last one is never superseded


SAVING_S = 90.0
"""The job saves until three steps became global, or this long (about 15 s on an idle machine)."""


class FleetNode:
    """A node in a process of its own (tests/storage/_fleet_node.py), driven by JSON lines."""

    def __init__(self, url: str, proxy: str, root, index: int, nodes: int, keep: int) -> None:
        root.mkdir(parents=True)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_fleet_node.py")), url, proxy,
                                      str(root), str(index), str(nodes), str(keep)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, command: dict) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"node exited {self.proc.wait(10)}"
        return json.loads(line)

    def close(self) -> dict:
        self.send({"close": True})
        end = self.receive()
        self.proc.wait(30)
        return end

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
