"""The prompt exit after a committed stop (spotguard._exit) keeps what users expect of sys.exit(75).

A real job (``_exit_job.py``: 2 loader workers, ``with Run``, ``try/finally``, a context manager,
an ``atexit`` handler, a file left open in a global, an unflushed print) stops itself with SIGTERM.
With the prompt exit and without it (``$SPOTGUARD_FAST_EXIT=0``) the process exits 75 with the
record's ``stop`` line, every teardown ran in order, the buffered output reached its file and no
loader worker outlives it; a program that catches the stop or fails after it keeps its own
status. Its iterator is still referenced at exit: that used to hang in
``multiprocessing``'s exit handler (the workers ignore SIGTERM) until the forced exit (76).
"""

from __future__ import annotations

import atexit
import subprocess
import sys
from pathlib import Path

import pytest

from _example import isolated_env
from spotguard import _exit, _record

JOB = Path(__file__).resolve().parent / "_exit_job.py"


def run_job(tmp_path: Path, fast: str, *extra: str) -> subprocess.CompletedProcess:
    env = isolated_env(tmp_path / "rt", SPOTGUARD_FAST_EXIT=fast, SPOTGUARD_RECORD=str(tmp_path / "record"))
    return subprocess.run([sys.executable, str(JOB), str(tmp_path), *extra], env=env, capture_output=True,
                          text=True, timeout=120)


def gone(pid: int) -> bool:
    """Not running (a zombie not yet reaped by init counts as gone: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("fast", ["1", "0"])
def test_the_stop_exits_75_after_every_teardown_and_leaves_no_worker(tmp_path, fast):
    done = run_job(tmp_path, fast)
    assert done.returncode == 75, done.stderr
    assert (tmp_path / "teardown").read_text().split() == ["finally", "context_exit", "atexit"]
    assert (tmp_path / "left_open").read_text() == "written, never flushed nor closed\n"
    assert done.stdout == "buffered, never flushed"
    stops = [e for e in _record.read(tmp_path / "record") if e["event"] == "stop"]
    assert len(stops) == 1 and stops[0]["saved"], stops
    workers = [int(p) for p in (tmp_path / "workers").read_text().split()]
    assert len(workers) == 2 and all(gone(p) for p in workers), workers


@pytest.mark.slow
@pytest.mark.parametrize("how, status", [("raise", 1), ("catch", 0)])
def test_a_program_that_does_not_end_with_the_stop_keeps_its_status(tmp_path, how, status):
    done = run_job(tmp_path, "1", how)
    assert done.returncode == status, done.stderr
    assert ("a finally block that fails after the stop" in done.stderr) == (how == "raise")
    assert (tmp_path / "teardown").read_text().split() == ["finally", "context_exit", "atexit"]
    workers = [int(p) for p in (tmp_path / "workers").read_text().split()]
    assert all(gone(p) for p in workers), workers


def test_a_caught_stop_exit_leaves_the_interpreter_exit_alone():
    """pytest catching Run's SystemExit must not turn pytest's own exit status into 75."""
    with pytest.raises(SystemExit) as stop:
        raise _exit.stop_exit(75)
    assert stop.value.code == 75 and isinstance(stop.value, SystemExit)
    _exit._exit_now()  # the atexit handler: the stop did not end the program, so it returns
    atexit.unregister(_exit._exit_now)
