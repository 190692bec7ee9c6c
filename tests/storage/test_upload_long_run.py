"""Issue 28: the upload queue in a long run (real stores, the real queue, no daemon process)."""

from __future__ import annotations

import logging
import time

from spotguard.storage.durable import Durable
from spotguard.storage.file import FileStore

from test_upload_queue import _queue


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
