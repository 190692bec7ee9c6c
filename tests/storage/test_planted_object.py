"""A wrong object planted under a content address (another job on a shared bucket, a truncating
tool, a lifecycle rule) is never reused: the upload sends the file again and a fresh restore of
that step succeeds. Each backend proves an object's content with its own checksum (``Store.holds``)."""

from __future__ import annotations

import hashlib
import os

import pytest
from spotguard.storage import Durable
from spotguard.storage.durable import object_key


@pytest.mark.parametrize("backend", ["file", "s3", "gcs", "azure"])
def test_a_planted_object_under_the_hash_is_sent_again_and_the_step_restores(backend, new_bucket, make_ckpt,
                                                                             tmp_path):
    store = new_bucket(backend)
    durable = Durable(store)
    victim = {"rank-0/w.bin": os.urandom(4096), "rank-0/tree.json": b'{"step": 2, "keys": ["w"]}'}
    sha = hashlib.sha256(victim["rank-0/tree.json"]).hexdigest()
    store.put_bytes(object_key(sha), b"planted: not the tree" * 27)  # under the victim's next hash
    same_size = hashlib.sha256(victim["rank-0/w.bin"]).hexdigest()
    store.put_bytes(object_key(same_size), os.urandom(4096))  # right size, wrong bytes
    info = durable.upload(make_ckpt(tmp_path / "a", 2, victim), "victim")
    assert (info.objects_uploaded, info.objects_skipped) == (2, 0)
    assert durable.latest("victim") == 2 and durable.verify("victim", 2) == []
    restored = durable.restore("victim", tmp_path / "fresh")  # a fresh node
    assert restored.name == "step-0000000002"
    assert {rel: (restored / rel).read_bytes() for rel in victim} == victim
    again = durable.upload(make_ckpt(tmp_path / "a", 3, victim), "victim")  # now proven: reused
    assert (again.objects_uploaded, again.objects_skipped) == (0, 2)
