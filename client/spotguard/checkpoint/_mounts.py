"""Which file system a checkpoint root is on, and whether its ``rename`` can be trusted.

The commit protocol publishes a checkpoint with one ``rename`` (``.tmp-step-*`` to ``step-*``, then
``latest``): atomic on a local disk, on NFS and on Lustre. A bucket mounted with a FUSE driver
(gcsfuse, mountpoint-s3, s3fs, goofys, blobfuse2, rclone, the bucket mounts of managed-spot
launchers) emulates it with copies and deletes, or refuses it, so a kill in the middle leaves half a
checkpoint under its final name. :func:`refuse_untrusted_rename` refuses such a root at start, in one
line, and names what to do instead: a node-local root, with the bucket as the durable store.

The mount is read from ``/proc/self/mountinfo`` (the last mount over the longest matching mount
point wins: that is the one a path resolves through). A FUSE file system whose rename *is* atomic
(a local overlay such as bindfs) may be allowed with ``SPOTGUARD_FUSE_RENAME_IS_ATOMIC=1``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from spotguard.checkpoint.errors import CheckpointError

__all__ = ["Mount", "mount_of", "refuse_untrusted_rename", "ALLOW_ENV"]

ALLOW_ENV = "SPOTGUARD_FUSE_RENAME_IS_ATOMIC"
MOUNTINFO = "/proc/self/mountinfo"


class Mount(NamedTuple):
    point: str
    fstype: str
    source: str


def mount_of(path: Path, mountinfo: str = MOUNTINFO) -> Mount | None:
    """The mount ``path`` (or its nearest existing parent) resolves through; None off Linux."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(_existing(path))
    best: Mount | None = None
    for line in lines:
        mount = _parse(line)
        if mount and _under(target, mount.point) and (best is None or len(mount.point) >= len(best.point)):
            best = mount
    return best


def refuse_untrusted_rename(root: Path) -> None:
    """CheckpointError when ``root`` is on a FUSE mount, unless :data:`ALLOW_ENV` is set."""
    mount = mount_of(root)
    if mount is None or not _is_fuse(mount.fstype) or os.environ.get(ALLOW_ENV) == "1":
        return
    raise CheckpointError(
        f"the checkpoint root {root} is on a FUSE mount ({mount.fstype} of {mount.source!r} at "
        f"{mount.point}), whose rename is not atomic: a kill mid-commit would leave a torn checkpoint "
        "under its final name. Use the node-local mode instead: a root on the node's own disk, with the "
        "bucket as the durable store (Run(durable=...) or the daemon's store settings), which uploads "
        f"each committed step. If this file system does rename atomically, set {ALLOW_ENV}=1")


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _parse(line: str) -> Mount | None:
    """``36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw`` -> (/mnt2, ext3, /dev/root)."""
    fields = line.split()
    try:
        separator = fields.index("-", 6)
        return Mount(_unescape(fields[4]), fields[separator + 1], _unescape(fields[separator + 2]))
    except (ValueError, IndexError):
        return None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), field)


def _under(path: str, point: str) -> bool:
    return path == point or path.startswith(point.rstrip("/") + "/")


def _is_fuse(fstype: str) -> bool:
    """``fuse`` and ``fuse.<driver>``; ``fuseblk`` (a block device through FUSE, e.g. ntfs-3g) aside."""
    return fstype == "fuse" or fstype.startswith("fuse.")
