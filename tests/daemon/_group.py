"""Run a script in a session of its own and end its whole process group if it overruns (a batch
script and the daemon it started share that group)."""

from __future__ import annotations

import os
import signal
import subprocess


def run_group(argv: list[str], *, cwd, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``(returncode, merged output)``; past ``timeout`` the group is SIGKILLed and the timeout raised."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode, output
