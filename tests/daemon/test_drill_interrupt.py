"""``spotguard drill`` stopped from outside, and a launch that hangs: real drills, daemons and signals.

* a drill killed with SIGKILL (a test's subprocess timeout, the OOM killer) cannot clean up, but
  the private daemon it started must not outlive it: the drill passes ``--parent-pid``, and the
  daemon stops once its parent is gone; nor may the launch it started, a child that left its
  session included, nor its temporary directory: its reaper stops and removes them, and a drill
  that ends leaves no reaper behind;
* SIGTERM (or Ctrl-C) stops the running launch and the daemon, removes the drill's temporary
  directory and exits 130 saying so, also when it lands while the daemon is still starting;
* a launch that hangs (here: at exit, after it recorded its finish) is killed at once, its whole
  process group too, and the failure names it, what it was doing, and its last output lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard_daemon.commands import drill as drill_module
from spotguard_daemon.commands.drill import Drill, DrillError
from spotguard_daemon.commands.drill_report import Live
from spotguard_daemon.commands.drill_tree import private_dir
from spotguard_daemon.proctree import descendants, stat_fields

DRILL = [sys.executable, "-m", "spotguard_daemon", "drill"]

HANG_AT_EXIT = """\
import signal, subprocess, sys, time
import spotguard

class Counter:
    n = 0
    def state_dict(self): return {"n": self.n}
    def load_state_dict(self, state): self.n = state["n"]

counter = Counter()
with spotguard.Run(sys.argv[1], state={"counter": counter}, save_every=5) as run:
    for _ in run.steps(20):
        counter.n += 1
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stuck exit that SIGTERM does not end either
helper = subprocess.Popen(["sleep", "60"])
print("training done", flush=True)
print(f"helper {helper.pid}", flush=True)
time.sleep(60)
"""
"""A spotguard job that finishes its run, then hangs at exit (a helper left running), ignoring SIGTERM."""


def alive(pid: int) -> bool:
    """Whether ``pid`` names a process that is not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in "ZX"


def wait_gone(pid: int, timeout: float) -> bool:
    give_up = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > give_up:
            return False
        time.sleep(0.05)
    return True


def daemon_of(drill_pid: int) -> int | None:
    """The pid of the private daemon the drill started, if one runs."""
    for pid in descendants(drill_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"spotguard_daemon" in argv and b"daemon" in argv and b"drill" not in argv:
            return pid
    return None


def reaper_of(drill_pid: int) -> int | None:
    """The pid of the drill's reaper, if one runs."""
    for pid in descendants(drill_pid):
        try:
            if b"spotguard_daemon.commands.drill_reaper" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def temp_dir_of(daemon_pid: int) -> Path:
    """The drill's temporary directory, from its daemon's ``--config /tmp/sg-drill-*/daemon.toml``."""
    argv = Path(f"/proc/{daemon_pid}/cmdline").read_bytes().decode().split("\0")
    config = Path(argv[argv.index("--config") + 1])
    assert config.parent.name.startswith("sg-drill-"), argv
    return config.parent


class Running:
    """``spotguard drill --no-reference -n 1 -- sleep 30`` (or ``command``): its one launch gets a
    notice, so it starts a daemon before the launch; the launch (``sleep``) gets nothing before
    its step 1, which never comes."""

    def __init__(self, tmp_path: Path, command: tuple[str, ...] = ("sleep", "30")) -> None:
        self.out = tmp_path / "drill.out"
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [*DRILL, "--no-reference", "-n", "1", "--launch-timeout", "60",
                 "--report-dir", str(tmp_path / "report"), "--", *command],
                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        self.daemon: int | None = None
        self.job: int | None = None
        self.temp: Path | None = None
        self.others: set[int] = set()
        """Other processes to kill at the end, if still there: the reaper, a job's children."""

    def wait_for_daemon(self, timeout: float = 30.0) -> int:
        """The daemon's pid, as soon as the daemon process exists (it may not answer yet)."""
        give_up = time.monotonic() + timeout
        while (pid := daemon_of(self.proc.pid)) is None:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < give_up, self.output()
            time.sleep(0.01)
        self.daemon, self.temp = pid, temp_dir_of(pid)
        return pid

    def wait_for_launch(self, timeout: float = 30.0) -> int:
        """The launch's pid, once the drill said it started it (its daemon answers by then)."""
        give_up = time.monotonic() + timeout
        while not (found := re.search(r"launch 1: started \(pid (\d+)\)", self.output())):
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < give_up, self.output()
            time.sleep(0.05)
        self.job = int(found[1])
        return self.job

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def clean_up(self) -> None:
        """Whatever the drill left (nothing, when it works): its launch's group, daemon, temp dir."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid, kill in ((self.job, os.killpg), (self.daemon, os.kill),
                          *((other, os.kill) for other in self.others)):
            if pid is not None and alive(pid):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self.temp is not None:
            subprocess.run(["rm", "-rf", str(self.temp)], check=False)


@pytest.fixture
def running(tmp_path):
    drill = Running(tmp_path)
    yield drill
    drill.clean_up()


@pytest.mark.timeout(90)
def test_a_drill_killed_with_sigkill_leaves_no_daemon_behind(running):
    daemon = running.wait_for_daemon()
    running.wait_for_launch()
    assert alive(daemon)
    running.proc.kill()  # no handler runs: what a subprocess timeout or the OOM killer does
    running.proc.wait()
    assert wait_gone(daemon, 5.0), f"the drill's daemon (pid {daemon}) outlived the killed drill"
    log = (running.out.parent / "report" / "daemon-01.log").read_text()
    assert f"the process that started this daemon (pid {running.proc.pid}) is gone" in log


ESCAPING = """\
import subprocess, time
subprocess.Popen(["sleep", "300"], start_new_session=True)  # out of the launch's group
time.sleep(300)
"""
"""A launch that outlives its drill unless stopped, with a child in a session of its own."""


def wait_until(found, timeout: float, every: float = 0.05):
    """``found()`` once true (its value), else its last value after ``timeout`` seconds."""
    give_up = time.monotonic() + timeout
    while not (value := found()) and time.monotonic() < give_up:
        time.sleep(every)
    return value


@pytest.mark.timeout(90)
def test_a_drill_killed_with_sigkill_leaves_no_launch_and_no_temp_dir_behind(tmp_path):
    running = Running(tmp_path, (sys.executable, "-c", ESCAPING))
    try:
        running.wait_for_daemon()
        running.others |= {reaper_of(running.proc.pid)} - {None}
        job = running.wait_for_launch()
        # seen once it left the launch's group: between its fork and its setsid it is still in it
        def out_of_the_group() -> set[int]:
            found = descendants(job)
            return found if all(stat_fields(pid)[2] != str(job) for pid in found) else set()

        escaped = wait_until(out_of_the_group, 30.0)
        running.others |= escaped
        assert escaped and all(stat_fields(pid)[2] != str(job) for pid in escaped)  # own group
        running.proc.kill()  # no handler runs, close() neither
        running.proc.wait()

        def left() -> set:
            return ({pid for pid in {job, *escaped} if alive(pid)}
                    | ({running.temp} if running.temp.exists() else set()))

        wait_until(lambda: not left(), 15.0, 0.1)
        assert left() == set(), "the killed drill left its launch or its temp dir behind"
    finally:
        running.clean_up()


@pytest.mark.timeout(90)
def test_a_drill_that_ends_leaves_no_reaper_behind(tmp_path):
    running = Running(tmp_path, (sys.executable, "-c", "import time; time.sleep(2)"))
    try:
        running.wait_for_daemon()
        reaper = reaper_of(running.proc.pid)
        running.others |= {reaper} - {None}
        assert reaper is not None, "the drill started no reaper"
        assert running.proc.wait(60) == 1, running.output()  # no spotguard run: FAILED, closed
        assert not alive(reaper), "the reaper outlived the drill that ended"
        assert not running.temp.exists()
    finally:
        running.clean_up()


@pytest.mark.timeout(90)
def test_sigterm_stops_the_launch_and_the_daemon_and_removes_the_temp_dir(running):
    daemon = running.wait_for_daemon()
    job = running.wait_for_launch()
    running.proc.send_signal(signal.SIGTERM)
    assert running.proc.wait(30) == 130, running.output()
    assert "spotguard drill: interrupted by SIGTERM" in running.output()
    assert not alive(daemon) and not alive(job), running.output()  # stopped, not left to die later
    assert not running.temp.exists()


@pytest.mark.timeout(90)
def test_sigterm_while_the_daemon_starts_stops_that_daemon_too(running):
    daemon = running.wait_for_daemon()  # the process exists; it answers only some 0.5 s later
    running.proc.send_signal(signal.SIGTERM)
    assert running.proc.wait(30) == 130, running.output()
    assert "launch 1: started" not in running.output()  # it landed before the daemon answered
    assert not alive(daemon), "a daemon still starting when the drill was stopped was left running"
    assert not running.temp.exists()


@pytest.mark.timeout(90)
def test_a_launch_that_hangs_at_exit_is_killed_whole_and_named_with_its_last_output(tmp_path):
    job = tmp_path / "hang_at_exit.py"
    job.write_text(HANG_AT_EXIT)
    started = time.monotonic()
    done = subprocess.run([*DRILL, "--launch-timeout", "4", "--report-dir", str(tmp_path / "report"),
                           "--", sys.executable, str(job), "ckpt"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr
    assert "reference ran longer than --launch-timeout (4 s). It was the uninterrupted run" in error
    assert "it recorded its finish at step 20, so it hangs at exit" in error
    assert "    | training done" in error  # its last output lines
    assert f"see {tmp_path / 'report' / 'reference.log'}" in error
    helper = int(re.search(r"helper (\d+)", error)[1])
    assert not alive(helper), "the hung launch's helper (same process group) was left running"
    # Killed at once (SIGKILL), not after STOP_S (10 s) of a SIGTERM the job ignores.
    assert took < 4 + drill_module.STOP_S, f"{took:.1f} s"


@pytest.mark.timeout(60)
def test_a_launch_hung_at_exit_is_failed_after_the_exit_grace_not_the_launch_timeout(
        tmp_path, monkeypatch):
    job = tmp_path / "hang_at_exit.py"
    job.write_text(HANG_AT_EXIT)
    monkeypatch.setattr(drill_module, "EXIT_GRACE_S", 1.0)
    report = tmp_path / "report"
    private_dir(report)
    run = Drill([sys.executable, str(job), str(tmp_path / "ckpt")], report, 1, 0, 300.0, Live(False))
    started = time.monotonic()
    try:
        with pytest.raises(DrillError, match=r"reference had not exited \d+ s after it recorded its "
                                             r"finish .* so it hangs at exit") as failed:
            run.reference()
    finally:
        run.close()
    assert time.monotonic() - started < 30  # not --launch-timeout's 300 s
    helper = int(re.search(r"helper (\d+)", str(failed.value))[1])
    assert not alive(helper)
    assert not run.sockets.exists()


def test_a_daemon_refuses_to_start_when_its_parent_pid_is_not_its_parent(tmp_path, sock_dir):
    done = subprocess.run([sys.executable, "-m", "spotguard_daemon", "daemon", "--platform", "none",
                           "--runtime-dir", str(sock_dir / "run"), "--state-dir", str(tmp_path / "state"),
                           "--parent-pid", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "its parent is not pid 1 (--parent-pid)" in done.stderr
    assert not (sock_dir / "run" / "requests.sock").exists()
