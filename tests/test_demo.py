"""``spotguard demo`` as users run it: a real subprocess with its real daemons and jobs.

The end-to-end run checks the timeline's story (start, durable commit, notice, exit 75, restore,
resume, finish, identical digests), that the workspace and the socket directory are removed, and
that no daemon or job is left running. The interrupted run checks that Ctrl-C stops every child.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard_daemon.commands.demo import verdict

DEMO = [sys.executable, "-m", "spotguard_daemon", "demo"]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes whose arguments contain ``text`` (the demo's workspace)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found


def workspace_of(output: str) -> tuple[Path, Path]:
    """The workspace and the socket directory that the demo named in its output."""
    workspace = re.search(r"\(workspace (\S+)\)", output)[1]
    sockets = re.search(r"sockets in (\S+)/node-1\)", output)[1]
    return Path(workspace), Path(sockets)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_demo_rides_out_a_preemption_and_cleans_up():
    done = subprocess.run([*DEMO, "--steps", "120", "--step-sleep", "0.01"], capture_output=True,
                          text=True, timeout=120)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert re.search(r"^\s+\d+\.\ds  node-1: daemon started \(pid \d+, platform none", out, re.M)
    assert "job started from scratch" in out
    first = int(re.search(r"checkpoint committed at step (\d+)", out)[1])
    assert re.search(rf"step {first} durable in file://", out)
    assert "notice: drill, deadline in 20 s" in out
    stopped = int(re.search(r"job saved an emergency checkpoint at step (\d+) and exited with "
                            r"status 75 \(EXIT_PREEMPTED\)", out)[1])
    assert stopped > first
    assert f"step {stopped} restored from the durable store" in out
    assert re.search(rf"job resumed at step {stopped}$", out, re.M)
    assert "job finished at step 120" in out
    assert "uninterrupted reference run finished at step 120" in out
    assert re.search(r"^result: final weights identical to an uninterrupted run "
                     r"\(sha256 [0-9a-f]{16}\)", out, re.M)
    workspace, sockets = workspace_of(out)
    assert not workspace.exists() and not sockets.exists()
    assert processes_mentioning(str(workspace)) == []


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ctrl_c_stops_every_child_and_keeps_the_workspace(tmp_path):
    workdir = tmp_path / "ws"
    proc = subprocess.Popen([*DEMO, "--workdir", str(workdir), "--step-sleep", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not any("job started from scratch" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines) + proc.stderr.read()
            lines.append(line)
        assert processes_mentioning(str(workdir)), "the job and the daemon should be running"
        proc.send_signal(signal.SIGINT)
        status = proc.wait(60)
    finally:  # SIGTERM first: the demo stops its children; a SIGKILL would orphan them
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert status == 130, proc.stderr.read()
    assert "interrupted" in proc.stderr.read()
    _, sockets = workspace_of("".join(lines))
    assert not sockets.exists()
    assert (workdir / "logs" / "job-1.log").is_file()
    assert processes_mentioning(str(workdir)) == []


def test_a_workdir_that_is_not_empty_is_refused(tmp_path):
    (tmp_path / "something").write_text("x")
    done = subprocess.run([*DEMO, "--workdir", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--workdir" in done.stderr and "not empty" in done.stderr
    assert "daemon started" not in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["something"]


def test_verdict_is_0_for_equal_digests_and_1_naming_both_otherwise(capsys):
    assert verdict("ab" * 32, "ab" * 32) == 0
    assert "identical to an uninterrupted run (sha256 abababababababab)" in capsys.readouterr().out
    assert verdict("ab" * 32, "cd" * 32) == 1
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "ab" * 32 in err and "cd" * 32 in err
