"""Local users made for a test (root only) and removed after it."""

from __future__ import annotations

import contextlib
import pwd
import subprocess
import uuid
from typing import Iterator


@contextlib.contextmanager
def new_user() -> Iterator[tuple[int, int]]:
    """A user made for the test and removed after it: (uid, gid)."""
    name = f"sgt{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], check=False)
