"""A newer commit abandons the upload in flight inside a file, not after it (issue 12.5), against a
real daemon process and a real file store.

One checkpoint file is one tensor, possibly GBs: an upload abandoned only at a file boundary keeps a
newer (or, during a notice, another job's) checkpoint waiting for the whole file. Here the upload is
paced to 1 MB/s (``storage.bandwidth_mbps``, applied per chunk read) so that a 12 MB file is seen
part-written in the bucket; the newer commit then becomes durable while that file is abandoned: its
partial copy removed, nothing stored under its content address.
"""

from __future__ import annotations

import hashlib
import os

import pytest
from spotguard.storage.durable import object_key
from test_adversarial_uploads import commit, durable_latest, uploads, wait_until, write_ckpt

pytestmark = pytest.mark.slow  # starts a daemon; the paced first chunk takes ~4 s


def partial_copies(bucket):
    return [p for p in bucket.rglob(".tmp-*") if p.is_file() and p.stat().st_size > 0]


def test_a_newer_commit_abandons_a_large_file_mid_file(daemon_factory, tmp_path):
    bucket = tmp_path / "bucket"
    daemon = daemon_factory(env={"SPOTGUARD_STORAGE__URL": f"file://{bucket}",
                                 "SPOTGUARD_STORAGE__BANDWIDTH_MBPS": "1",
                                 "SPOTGUARD_STORAGE__CONCURRENCY": "1"})
    root = daemon.checkpoint_root / "job"
    big = os.urandom(12 * 1024 * 1024)  # 3 chunks of the file store's 4 MiB copy: ~12 s paced
    commit(daemon, "job", write_ckpt(root, 1, {"w.bin": big}, job="job"), 1)
    wait_until(lambda: partial_copies(bucket), "the big file to be part-written", daemon)
    assert uploads(daemon)["uploading"]["step"] == 1

    commit(daemon, "job", write_ckpt(root, 2, {"w.bin": b"newer"}, job="job"), 2)
    wait_until(lambda: durable_latest(bucket, "job") == 2, "the newer checkpoint", daemon)
    assert not (bucket / object_key(hashlib.sha256(big).hexdigest())).exists(), \
        "the old file was sent whole before the newer checkpoint"
    assert "job step 1 superseded" in daemon.output()
    wait_until(lambda: not partial_copies(bucket) and not list(bucket.rglob(".tmp-*")),
               "the abandoned partial copy to be removed", daemon)
    wait_until(lambda: uploads(daemon)["pending"] == [] and uploads(daemon)["uploading"] is None,
               "the queue to be idle (the pointer is written before the upload is cleared)", daemon)
