"""What S3 is asked to check: the checksum headers of each request, seen on the wire to moto.

moto stores the checksums it is sent without verifying them, so these tests pin what AWS (which
does verify) receives: an object sent in one request carries its expected sha256, each part of a
multipart upload its own sha256, so that S3's composite checksum proves a large object's bytes and an
unchanged large file is not sent again.
"""

from __future__ import annotations

import base64
import hashlib

import pytest


def b64sha256(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


@pytest.fixture
def s3(new_bucket):
    """A store on moto and the (operation, headers) of every request it sends."""
    store, sent = new_bucket("s3"), []

    def record(request, **kwargs):
        operation = kwargs["event_name"].rsplit(".", 1)[-1]
        sent.append((operation, {k.lower(): v for k, v in request.headers.items()}))

    store._client.meta.events.register("before-send.s3", record)
    return store, sent


def checksum_headers(headers: dict) -> dict:
    as_text = {k: v.decode() if isinstance(v, bytes) else v for k, v in headers.items()}
    return {k: v for k, v in as_text.items() if k.startswith("x-amz-checksum-") or k == "x-amz-trailer"}


def test_put_bytes_asks_s3_to_check_the_sha256(s3):
    store, sent = s3
    store.put_bytes("jobs/job/latest", b"step-0000000001\n")
    [(operation, headers)] = [s for s in sent if s[0] == "PutObject"]
    assert checksum_headers(headers)["x-amz-checksum-sha256"] == b64sha256(b"step-0000000001\n")
    assert store.get_bytes("jobs/job/latest") == b"step-0000000001\n"


def test_a_small_file_is_sent_with_its_content_address_for_s3_to_check(s3, tmp_path):
    store, sent = s3
    data = b"w" * 5000
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    assert store.put_file(f"objects/sha256/{sha}", path, sha256=sha, size=len(data)) == len(data)
    [(_, headers)] = [s for s in sent if s[0] == "PutObject"]
    assert checksum_headers(headers)["x-amz-checksum-sha256"] == b64sha256(data)
    assert store.get_bytes(f"objects/sha256/{sha}") == data


def test_each_part_of_a_large_file_carries_its_sha256(s3, tmp_path):
    store, sent = s3
    data = bytes(range(256)) * (6 * 1024 * 1024 // 256)  # over part_size: multipart (parts >= 5 MiB)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    store.put_file(f"objects/sha256/{sha}", path, sha256=sha, size=len(data))
    parts = [checksum_headers(h) for op, h in sent if op == "UploadPart"]
    assert len(parts) == 2, [op for op, _ in sent]
    halves = [data[: 5 << 20], data[5 << 20:]]  # s3transfer's parts: at least 5 MiB, sent concurrently
    assert sorted(h.get("x-amz-checksum-sha256", "") for h in parts) == sorted(b64sha256(p) for p in halves) \
        or all(h.get("x-amz-trailer") == "x-amz-checksum-sha256" for h in parts), parts
    assert store.get_bytes(f"objects/sha256/{sha}") == data


def test_an_unchanged_large_file_is_proven_by_its_composite_checksum_and_not_sent_again(s3, tmp_path,
                                                                                       make_ckpt):
    from spotguard.storage import Durable

    store, sent = s3
    durable = Durable(store)
    frozen = {"base.bin": bytes(range(256)) * (6 * 1024 * 1024 // 256)}  # multipart: 2 parts
    first = durable.upload(make_ckpt(tmp_path / "a", 1, {**frozen, "lora.bin": b"1" * 100}), "ft")
    assert first.objects_uploaded == 2
    sent.clear()
    again = durable.upload(make_ckpt(tmp_path / "a", 2, {**frozen, "lora.bin": b"2" * 100}), "ft")
    assert (again.objects_uploaded, again.objects_skipped) == (1, 1)  # only the changed adapter
    assert not [op for op, _ in sent if op in ("CreateMultipartUpload", "UploadPart")]
    assert durable.verify("ft", 2) == []


def test_a_planted_large_object_of_the_right_size_is_not_proven(s3, tmp_path):
    store, _ = s3
    data = bytes(range(256)) * (6 * 1024 * 1024 // 256)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    planted = tmp_path / "planted.bin"
    planted.write_bytes(data[:-1] + b"X")  # same size, same part layout, one byte off
    store.put_file(f"objects/sha256/{sha}", planted, sha256=hashlib.sha256(planted.read_bytes()).hexdigest(),
                   size=len(data))
    assert not store.holds(f"objects/sha256/{sha}", path, sha, len(data))
    store.put_file(f"objects/sha256/{sha}", path, sha256=sha, size=len(data))
    assert store.holds(f"objects/sha256/{sha}", path, sha, len(data))
