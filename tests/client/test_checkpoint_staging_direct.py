"""Large page-aligned writes go O_DIRECT from the staging buffer, and a restore reads whole pages
O_DIRECT into its page-aligned buffers; everything else through the page cache, as before."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch

from spotguard.checkpoint import _fs
from spotguard.checkpoint.staging import Stager, tensor_specs

O_DIRECT = getattr(os, "O_DIRECT", 0)


def staged(nbytes: int) -> torch.Tensor:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    stager = Stager(pin_memory=False)
    stager.prepare(tensor_specs({"t": src}))
    return stager.snapshot({"t": src}).tensors[0]


def write(path, data: memoryview) -> list[bool]:
    """Write through write_all; the O_DIRECT flag of the fd at each chunk, seen from the pace hook."""
    seen: list[bool] = []

    def pace(fn, fd, piece):
        seen.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT))
        return fn(fd, piece)

    fd = _fs.open_new(path)
    try:
        _fs.write_all(fd, data, pace)
        os.fsync(fd)
    finally:
        os.close(fd)
    return seen


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("nbytes", [(20 << 20), (3 << 20) + 123])
def test_aligned_staging_buffer_is_written_direct_and_the_tail_buffered(tmp_path, nbytes):
    buf = staged(nbytes)
    assert buf.data_ptr() % 4096 == 0
    seen = write(tmp_path / "f", memoryview(buf.numpy()))
    assert (tmp_path / "f").read_bytes() == buf.numpy().tobytes()
    if not any(seen):
        pytest.skip("the file system under tmp_path refuses O_DIRECT")
    assert seen[0] and seen[-1] == (nbytes % 4096 == 0)


def test_unaligned_or_small_data_is_written_buffered(tmp_path):
    buf = staged(4 << 20)
    unaligned = memoryview(buf.numpy())[100:]
    assert not any(write(tmp_path / "a", unaligned))
    assert (tmp_path / "a").read_bytes() == bytes(unaligned)
    small = memoryview(bytes(range(256)) * 16)
    assert not any(write(tmp_path / "b", small))
    assert (tmp_path / "b").read_bytes() == bytes(small)


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
def test_one_fd_takes_an_aligned_write_then_an_unaligned_one(tmp_path):
    """The emergency path streams a file's tensors through one fd, pinned chunk after chunk: an
    aligned whole-page chunk (written direct) must not leave O_DIRECT on for the next, unaligned
    write, and a chunk at an unaligned file offset is written buffered. Found on an H100, where every
    pinned chunk is page-aligned: the second write failed with EINVAL."""
    aligned, odd = staged(2 << 20), memoryview(bytes(range(256)) * 4001)
    fd = _fs.open_new(tmp_path / "f")
    try:
        _fs.write_all(fd, memoryview(aligned.numpy()))
        flag_after_aligned = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)
        _fs.write_all(fd, odd)
        _fs.write_all(fd, memoryview(aligned.numpy()))  # now at an unaligned offset
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT
        os.fsync(fd)
    finally:
        os.close(fd)
    assert not flag_after_aligned
    expected = aligned.numpy().tobytes()
    assert (tmp_path / "f").read_bytes() == expected + bytes(odd) + expected


@pytest.mark.parametrize("nbytes", [(20 << 20), (3 << 20) + 123])
def test_a_restore_reads_whole_pages_direct_and_the_tail_buffered(tmp_path, nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    (tmp_path / "f").write_bytes(data.numpy().tobytes())
    out = staged(nbytes)
    assert out.data_ptr() % 4096 == 0
    out.zero_()
    with _fs.FileReader(tmp_path / "f") as reader:
        spans = range(0, nbytes, 1 << 20)
        for start in reversed(spans):  # in any order, as the restore's threads take them
            reader.read(memoryview(out.numpy()), start, min(start + (1 << 20), nbytes))
        direct = reader.direct
    assert torch.equal(out, data)
    if O_DIRECT and not direct:
        pytest.skip("the file system under tmp_path refuses O_DIRECT")


@pytest.mark.parametrize("nbytes", [(20 << 20) + 4096, (3 << 20) + 123])
def test_a_read_through_a_bounce_buffer_fills_any_destination_exactly(tmp_path, nbytes):
    """The bounce buffer (a huge page the disk reads into, copied out of) lets the destination be
    unaligned too; spans of 16 MiB, in any order; the tail buffered; a short file still an error."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    (tmp_path / "f").write_bytes(data.numpy().tobytes())
    bounce = staged(2 << 20)
    out = torch.zeros(nbytes + 3, dtype=torch.uint8)
    with _fs.FileReader(tmp_path / "f") as reader:
        for start in reversed(range(0, nbytes, 16 << 20)):
            reader.read(memoryview(out.numpy())[3:], start, min(start + (16 << 20), nbytes), memoryview(bounce.numpy()))
        with pytest.raises(ValueError, match="do not fit"):
            reader.read(memoryview(out.numpy())[3:], 0, nbytes + 1, memoryview(bounce.numpy()))
        direct = reader.direct
    assert torch.equal(out[3:], data) and int(out[:3].sum()) == 0
    (tmp_path / "short").write_bytes(data[: 2 << 20].numpy().tobytes())
    with _fs.FileReader(tmp_path / "short") as reader, pytest.raises(EOFError, match="shorter"):
        reader.read(memoryview(out.numpy()), 0, 3 << 20, memoryview(bounce.numpy()))
    if O_DIRECT and not direct:
        pytest.skip("the file system under tmp_path refuses O_DIRECT")


def test_an_unaligned_buffer_is_read_buffered(tmp_path):
    data = bytes(range(256)) * 8192
    (tmp_path / "f").write_bytes(data)
    out = bytearray(len(data) + 100)
    with _fs.FileReader(tmp_path / "f") as reader:
        reader.read(memoryview(out)[100:], 0, len(data))
    assert bytes(out[100:]) == data


def test_a_file_shorter_than_listed_is_an_error_not_zeros(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * (8192 + 10))
    out = staged(3 << 20)
    with _fs.FileReader(tmp_path / "f") as reader, pytest.raises(EOFError, match="shorter"):
        reader.read(memoryview(out.numpy()), 0, 3 << 20)


def test_a_symlink_is_not_followed(tmp_path):
    (tmp_path / "target").write_bytes(b"secret")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(OSError):
        _fs.FileReader(tmp_path / "link")
