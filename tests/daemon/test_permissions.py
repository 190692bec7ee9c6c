"""Runtime files are private: directories 0700, sockets and state 0600, one daemon per directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from spotguard.protocol import NotifyRequest
from spotguard_daemon.core.server import ServerError, lock_runtime_dir, secure_dir

pytestmark = pytest.mark.slow


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_runtime_dir_sockets_and_state_file_are_private(daemon_factory):
    old_umask = os.umask(0o022)  # the daemon must not rely on the caller's umask
    try:
        daemon = daemon_factory()
    finally:
        os.umask(old_umask)
    assert mode(daemon.runtime_dir) == 0o700
    for name in ("events.sock", "requests.sock"):
        path = daemon.runtime_dir / name
        assert stat.S_ISSOCK(os.stat(path).st_mode) and mode(path) == 0o600, name
    assert daemon.request(NotifyRequest(deadline_seconds=60)).ok
    assert mode(daemon.state_dir / "notices.json") == 0o600
    assert mode(daemon.state_dir) == 0o700


def test_a_world_writable_existing_runtime_dir_is_refused_in_one_line_and_left_alone(sock_dir, daemon_factory):
    run = sock_dir / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    daemon = daemon_factory(start=False)
    result = subprocess.run([sys.executable, "-m", "spotguard_daemon", "daemon", *daemon.args],
                            env=daemon.env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "is writable by other users (mode 777)" in result.stderr
    assert mode(run) == 0o777, "a directory the daemon did not create is not its to chmod"


def test_a_second_daemon_on_the_same_runtime_dir_is_refused(daemon_factory):
    first = daemon_factory()
    second = daemon_factory(start=False)
    result = subprocess.run([sys.executable, "-m", "spotguard_daemon", "daemon", *second.args],
                            env=second.env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "another spotguard daemon is running" in result.stderr
    assert first.request(NotifyRequest()).ok, "the first daemon keeps its sockets"


def test_someone_elses_directory_is_refused(sock_dir):
    foreign = sock_dir / "foreign"
    foreign.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory away")
    os.chown(foreign, 65534, 65534)
    with pytest.raises(ServerError, match="belongs to uid 65534"):
        secure_dir(foreign)


def test_lock_is_exclusive_within_one_process_too(sock_dir):
    fd = lock_runtime_dir(sock_dir / "run")
    try:
        with pytest.raises(ServerError, match="another spotguard daemon"):
            lock_runtime_dir(sock_dir / "run")
    finally:
        os.close(fd)
    os.close(lock_runtime_dir(sock_dir / "run"))  # free again once released


def test_status_says_a_registered_process_that_now_runs_setuid_is_not_signalled(daemon_factory):
    """A process of another user is registered (by root), then runs a setuid program (su, waiting
    for a password): its effective uid is root's now, so the daemon would not signal it, and
    ``status`` must not say it would."""
    import re
    import shutil
    import time

    from spotguard.protocol import RegisterRequest, StatusRequest

    su = shutil.which("su")
    if os.geteuid() != 0 or su is None or not os.stat(su).st_mode & stat.S_ISUID:
        pytest.skip("needs root and a setuid su")
    daemon = daemon_factory()
    user = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "sh", "-c",
                             f"read line; exec {su} root -c true"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20  # setpriv runs as root until it has dropped to nobody
        while not re.search(r"^Uid:\t65534\t65534\t65534\t", open(f"/proc/{user.pid}/status").read(), re.M):
            assert time.monotonic() < deadline and user.poll() is None, "setpriv did not drop to nobody"
            time.sleep(0.02)
        assert daemon.request(RegisterRequest(pid=user.pid)).data["signal"] is True

        def shown() -> bool:
            clients = daemon.request(StatusRequest()).data["clients"]
            return next(c["signal"] for c in clients if c["pid"] == user.pid)

        assert shown() is True
        user.stdin.write(b"go\n")
        user.stdin.flush()
        deadline = time.monotonic() + 20
        while "Uid:\t65534\t0\t" not in open(f"/proc/{user.pid}/status").read():
            assert time.monotonic() < deadline and user.poll() is None, "su did not start"
            time.sleep(0.02)
        assert shown() is False
    finally:
        user.kill()
        user.wait()
