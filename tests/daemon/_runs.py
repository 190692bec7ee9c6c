"""Runs of a job for restart tests: each run is a real process of its own (a ``sleep`` child the
test registers and reports for), because the daemon counts a restart only when another process
registers after the job's previous rank 0 is gone. A run ignores SIGUSR1, the notices' signal."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


class Runs:
    """Start runs one after another; starting one ends (and reaps) the one before."""

    def __init__(self) -> None:
        self.current: subprocess.Popen | None = None

    def next(self) -> int:
        """End the current run's process, start another; its pid."""
        self.end()
        # SIGUSR1 ignored (the notices' signal), inherited through exec: wait until sleep runs
        self.current = subprocess.Popen(["sh", "-c", "trap '' USR1; exec sleep 600"])
        comm = Path(f"/proc/{self.current.pid}/comm")
        deadline = time.monotonic() + 10
        while comm.read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.current.pid

    def end(self) -> None:
        if self.current is not None:
            self.current.kill()
            self.current.wait()
            self.current = None
