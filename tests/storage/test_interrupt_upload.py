"""An upload is abandoned mid-file (issue 12.5): ``put_file(..., interrupt=)`` calls the hook with
the size of each chunk before it reads it, and an :class:`Interrupted` the hook raises propagates as
itself from every backend (not translated into a StoreError, not retried by Durable), leaves no
object under the key (the multipart / resumable / block upload is never committed; the file store's
temporary file is removed), and the same file uploads whole afterwards."""

from __future__ import annotations

import hashlib
import os
from typing import Callable

import pytest

from spotguard.storage import Durable, Interrupted
from spotguard.storage.durable import object_key

BIG = 16 * 1024 * 1024 + 4321  # > 3 chunks of every backend (S3 parts >= 5 MiB, file copies 4 MiB)


class Abandoned(Interrupted):
    pass


def interrupt_after(chunks: int) -> tuple[list[int], Callable[[int], None]]:
    calls = [0]

    def interrupt(n: int) -> None:
        assert 0 < n <= 5 * 1024 * 1024
        calls[0] += 1
        if calls[0] > chunks:
            raise Abandoned(f"after {chunks} chunks")
    return calls, interrupt


def leftovers(store) -> list[str]:
    """Temporary files or unfinished multipart uploads a backend can list."""
    if store.url.startswith("file://"):
        return [p.name for p in store.root.rglob("*") if p.name.startswith(".tmp-")]
    if store.url.startswith("s3://"):
        listing = store._client.list_multipart_uploads(Bucket=store.bucket)
        return [u["Key"] for u in listing.get("Uploads", [])]
    return []


def test_interrupt_abandons_put_file_mid_file(store, tmp_path):
    data = os.urandom(BIG)
    path, sha = tmp_path / "w.bin", hashlib.sha256(data).hexdigest()
    path.write_bytes(data)
    calls, interrupt = interrupt_after(2)
    with pytest.raises(Abandoned, match="after 2 chunks"):
        store.put_file("objects/w", path, sha256=sha, size=len(data), interrupt=interrupt)
    assert calls[0] == 3  # stopped at the third chunk, not after the whole file
    assert not store.exists("objects/w") and list(store.list("objects/")) == []
    assert leftovers(store) == []
    sent = store.put_file("objects/w", path, sha256=sha, size=len(data), interrupt=lambda n: None)
    assert sent == len(data)
    assert store.get_bytes("objects/w") == data


def test_durable_lets_interrupted_pass_unretried(store, make_ckpt, tmp_path):
    data = os.urandom(BIG)
    ckpt = make_ckpt(tmp_path / "local", 1, {"w.bin": data})
    calls, interrupt = interrupt_after(1)
    with pytest.raises(Abandoned):
        Durable(store, attempts=4).upload(ckpt, "job", interrupt=interrupt)
    assert calls[0] == 2  # one attempt: Interrupted is not a TransientError to retry
    assert not store.exists(object_key(hashlib.sha256(data).hexdigest()))
    assert Durable(store).upload(ckpt, "job").objects_uploaded == 1
