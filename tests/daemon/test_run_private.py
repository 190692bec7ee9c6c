"""``spotguard run``'s private directory: a supervisor killed by SIGKILL leaves it, the next start
removes it; a live supervisor's, another user's and anything not plainly ours are left alone.

Real supervisors (``python -m spotguard_daemon run --no-daemon``) and signals, in a TMPDIR of the
test's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard_daemon.commands.run_private import PREFIX, Private, sweep

RUN = [sys.executable, "-m", "spotguard_daemon", "run", "--no-daemon", "--"]


def env(tmp: Path) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}, "TMPDIR": str(tmp)}


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def privates(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.iterdir() if p.name.startswith(PREFIX))


def test_a_supervisor_killed_with_sigkill_leaves_its_directory_to_the_next_start(tmp_path):
    ready, started = tmp_path / "ready", []
    job = [sys.executable, "-c", f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"]
    try:
        started.append(killed := subprocess.Popen(RUN + job, env=env(tmp_path), start_new_session=True))
        wait_for(ready.exists, "the job's start")
        started.append(alive := subprocess.Popen(RUN + [sys.executable, "-c", "import time; time.sleep(60)"],
                                                 env=env(tmp_path), start_new_session=True))
        wait_for(lambda: len(privates(tmp_path)) == 2, "the second supervisor's directory")
        os.killpg(killed.pid, signal.SIGKILL)  # the supervisor and its job, without a word
        killed.wait(10)
        left = [p for p in privates(tmp_path) if p.name.startswith(f"{PREFIX}{killed.pid}-")]
        assert len(left) == 1  # nobody could remove it
        (left[0] / "record.jsonl").write_text("{}\n")  # a record the job had written
        assert subprocess.run(RUN + ["true"], env=env(tmp_path), timeout=60).returncode == 0
        assert not left[0].exists()  # swept by the next start
        assert [p.name.split("-")[2] for p in privates(tmp_path)] == [str(alive.pid)]  # the live one stays
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_only_a_dead_supervisors_own_private_directory_is_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a pid no process has now

    def made(name: str, mode: int = 0o700) -> Path:
        path = tmp_path / name
        path.mkdir(mode=mode)
        path.chmod(mode)
        return path
    swept = [made(f"{PREFIX}{pid}-empty"), made(f"{PREFIX}{pid}-record")]
    (swept[1] / "record.jsonl").write_text("{}\n")
    kept = [made(f"{PREFIX}abc123"),  # an older release's: its supervisor may live
            made(f"{PREFIX}{pid}-open", 0o755),  # not private: not ours to judge
            made(f"{PREFIX}{pid}-more"), made(f"{PREFIX}{pid}-linked"), made(f"{PREFIX}{os.getpid()}-alive")]
    (kept[2] / "precious.ckpt").write_text("x")  # something else inside: left as it is
    (kept[3] / "record.jsonl").symlink_to(tmp_path / "elsewhere")
    kept += [made(f"{PREFIX}99999999999999999999-huge"), made(f"{PREFIX}0-zero"),  # no pid: not ours
             made(f"{PREFIX}{pid}"), made(f"{PREFIX}{pid}-")]
    target = made("somewhere-else")
    (tmp_path / f"{PREFIX}{pid}-link").symlink_to(target)
    if os.getuid() == 0:  # another user's directory (root can make one here)
        kept.append(made(f"{PREFIX}{pid}-nobody"))
        os.chown(kept[-1], 65534, 65534)
    locked = Private(tmp_path)  # a supervisor's start: it sweeps, then makes and locks its own
    try:
        assert not any(p.exists() for p in swept)
        assert all(p.exists() for p in kept) and target.exists() and (tmp_path / f"{PREFIX}{pid}-link").is_symlink()
        assert sweep(tmp_path) == 0 and locked.path.exists()
    finally:
        locked.close()
    assert not locked.path.exists()


def test_a_live_supervisor_in_another_pid_namespace_keeps_its_directory(tmp_path):
    """Its pid means nothing here (so it looks dead), but its lock holds."""
    import fcntl

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = tmp_path / f"{PREFIX}{int(dead.stdout)}-elsewhere"
    path.mkdir(mode=0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert sweep(tmp_path) == 0 and path.exists()
    finally:
        os.close(fd)
    assert sweep(tmp_path) == 1 and not path.exists()


@pytest.mark.parametrize("base", ["missing", "file"])
def test_a_temp_directory_that_cannot_be_listed_sweeps_nothing(tmp_path, base):
    path = tmp_path / base
    if base == "file":
        path.write_text("")
    assert sweep(path) == 0
