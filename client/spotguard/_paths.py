"""Where the daemon's sockets live, computed the same way by the daemon and its clients, and whether
a client may trust what listens there.

Both sides read the same environment variables as the daemon's settings
(``SPOTGUARD_RUNTIME_DIR``, ``SPOTGUARD_ZMQ__PUB_ENDPOINT``, ``SPOTGUARD_ZMQ__REQUEST_ENDPOINT``), so a
training process started beside a daemon finds it without configuration.

:func:`untrusted` is every client's check before it talks to an ``ipc://`` socket: the default
``/tmp/spotguard-<uid>`` (no ``XDG_RUNTIME_DIR``) is a name any local user can create first and
serve a fake daemon in. A socket's directory is trusted only when it, and every directory above
it, belongs to this user or root, and no other user can write to it (above it: no other user can
write without the sticky bit, as on ``/tmp``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["default_runtime_dir", "pub_endpoint", "request_endpoint", "untrusted"]

FIX = "set SPOTGUARD_RUNTIME_DIR (or XDG_RUNTIME_DIR) to a directory of your own"


def default_runtime_dir() -> Path:
    """``$SPOTGUARD_RUNTIME_DIR``, ``$RUNTIME_DIRECTORY`` (systemd), ``/run/spotguard`` as root,
    else ``$XDG_RUNTIME_DIR/spotguard``, else ``/tmp/spotguard-<uid>``."""
    if os.environ.get("SPOTGUARD_RUNTIME_DIR"):
        return Path(os.environ["SPOTGUARD_RUNTIME_DIR"])
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path("/run/spotguard")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "spotguard" if xdg else Path(f"/tmp/spotguard-{os.geteuid()}")


def pub_endpoint() -> str:
    return os.environ.get("SPOTGUARD_ZMQ__PUB_ENDPOINT") or f"ipc://{default_runtime_dir()}/events.sock"


def request_endpoint() -> str:
    return os.environ.get("SPOTGUARD_ZMQ__REQUEST_ENDPOINT") or f"ipc://{default_runtime_dir()}/requests.sock"


def untrusted(endpoint: str) -> str | None:
    """Why the daemon at ``endpoint`` must not be trusted, in one line that names the fix; None for
    a ``tcp://`` endpoint and for an ``ipc://`` socket whose directory is trusted or does not exist
    yet (nothing to talk to). The socket's directory and those above it are checked as written and
    as resolved, so a symlink planted by another user is refused too."""
    if not endpoint.startswith("ipc://"):
        return None
    directory = Path(os.path.abspath(endpoint[len("ipc://"):])).parent
    resolved = Path(os.path.realpath(directory))
    return _unsafe(directory) or (_unsafe(resolved) if resolved != directory else None)


def _unsafe(directory: Path) -> str | None:
    me = os.geteuid()
    for path in (directory, *directory.parents):
        try:
            info = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue  # nothing there yet
        except OSError as exc:
            return f"cannot check the daemon's socket directory {path}: {exc.strerror}; {FIX}"
        if info.st_uid not in (me, 0):
            return (f"{path} belongs to uid {info.st_uid}, not to this user ({me}) or root: another user "
                    f"may serve a fake daemon there, so it is not used; have it removed (by its owner or root) or {FIX}")
        if stat.S_ISLNK(info.st_mode):
            continue  # its target is checked as resolved
        shared = info.st_mode & 0o022 and (path == directory or not info.st_mode & stat.S_ISVTX)
        if shared:
            return (f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): another "
                    f"user could serve a fake daemon there, so it is not used; run chmod go-w {path} "
                    f"or {FIX}")
    return None
