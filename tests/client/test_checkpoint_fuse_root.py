"""A checkpoint root on a FUSE mount (where bucket drivers live: gcsfuse, mountpoint-s3, s3fs) is
refused at start in one line naming the node-local mode (issue 24, item 4). The mount is real:
bindfs, a FUSE file system, over a temporary directory."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

import spotguard
from spotguard.checkpoint import CheckpointError, Checkpointer
from spotguard.checkpoint._mounts import ALLOW_ENV, mount_of


@pytest.fixture
def fuse_dir(tmp_path):
    if shutil.which("bindfs") is None or not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs root, /dev/fuse and bindfs (scripts/install-system-packages.sh)")
    source, point = tmp_path / "bucket", tmp_path / "mnt"
    source.mkdir()
    point.mkdir()
    subprocess.run(["bindfs", str(source), str(point)], check=True, timeout=30)
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True, timeout=30)


def test_a_root_on_a_fuse_mount_is_refused_in_one_line_naming_the_node_local_mode(fuse_dir, monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    root = fuse_dir / "ckpt"
    with pytest.raises(CheckpointError) as refused:
        spotguard.Run(root, model=torch.nn.Linear(2, 2), daemon=False)
    message = str(refused.value)
    assert "\n" not in message and f"{root} is on a FUSE mount (fuse of " in message, message
    assert "node-local mode" in message and ALLOW_ENV in message, message
    assert not root.exists()  # refused before anything was written


def test_a_fuse_mount_said_to_rename_atomically_is_used(fuse_dir, monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    checkpointer = Checkpointer(fuse_dir / "ckpt")
    try:
        checkpointer.save(1, {"model": torch.nn.Linear(2, 2).state_dict()}, blocking=True)
        assert checkpointer.latest().step == 1
    finally:
        checkpointer.close()


def test_a_local_disk_root_is_not_a_fuse_mount(tmp_path):
    mount = mount_of(tmp_path / "not" / "yet" / "made")
    assert mount is not None and not mount.fstype.startswith("fuse")


def test_the_last_mount_over_the_longest_point_wins_and_escapes_are_read(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    spaced = tmp_path / "my bucket"
    spaced.mkdir()
    mountinfo.write_text(
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        f"40 22 0:50 / {str(spaced).replace(' ', chr(92) + '040')} rw shared:7 - ext4 /dev/sdb rw\n"
        f"41 40 0:51 / {str(spaced).replace(' ', chr(92) + '040')} rw - fuse.gcsfuse my-bucket rw\n")
    assert mount_of(spaced / "ckpt", str(mountinfo)) == (str(spaced), "fuse.gcsfuse", "my-bucket")
    assert mount_of(tmp_path, str(mountinfo)).fstype == "ext4"
