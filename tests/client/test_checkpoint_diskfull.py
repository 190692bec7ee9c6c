"""ENOSPC on a real size-limited file system (tmpfs, mounted as root)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from spotguard.checkpoint import Checkpointer, CheckpointDiskFullError


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("blocking", [True, False])
def test_disk_full_is_a_clear_error_and_previous_still_loads(small_fs, blocking):
    root = small_fs / "ckpt"
    ck = Checkpointer(root)
    ck.save(1, {"t": torch.full((3 << 17,), 1.0)}, blocking=True)  # 1.5 MiB fits
    huge = {"t": torch.full((3 << 20,), 2.0)}  # 12 MiB does not
    with pytest.raises(CheckpointDiskFullError) as err:
        ck.save(2, huge, blocking=blocking)
        ck.wait()
    message = str(err.value)
    assert str(root) in message and f"needs {12 << 20} bytes" in message
    assert sorted(os.listdir(root)) == ["latest", "step-0000000001"]  # tmp dir removed
    target = {"t": torch.zeros(3 << 17)}
    assert ck.load_latest(target).step == 1 and target["t"][0] == 1
    ck.save(3, {"t": torch.full((3 << 17,), 3.0)}, blocking=True)  # space is back: saves work again
    ck.close()
    assert ck.latest().step == 3
