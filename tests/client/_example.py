"""Launch ``examples/train_plain.py`` as a real subprocess and read its output line by line."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_plain.py"


def isolated_env(runtime: Path, **extra: str) -> dict[str, str]:
    """The environment for a child: its own runtime dir, so no daemon on this machine is reached."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(SPOTGUARD_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def example_args(ckpt: Path, steps: int, *extra: str) -> list[str]:
    return [str(EXAMPLE), "--steps", str(steps), "--ckpt-dir", str(ckpt), *extra]


class Proc:
    """A child process whose merged stdout/stderr lines are collected by a reader thread."""

    def __init__(self, argv: list[str], env: dict[str, str], **popen: object) -> None:
        self.popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, **popen)
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def example(cls, ckpt: Path, steps: int, *extra: str, env: dict[str, str], **popen: object) -> "Proc":
        return cls([sys.executable, *example_args(ckpt, steps, *extra)], env, **popen)

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line)

    def wait_line(self, pattern: str, timeout: float = 30.0) -> re.Match:
        """Block until a line matches ``pattern`` (searched); fail with the output so far."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                found = re.search(pattern, self._queue.get(timeout=left))
            except queue.Empty:
                break
            if found:
                return found
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + self.output)

    def finish(self, timeout: float = 60.0) -> int:
        rc = self.popen.wait(timeout)
        # The reader ends at the pipe's EOF; a child that left a grandchild holding the pipe open
        # must not hang the test, so the wait is bounded (a fixed sleep lost lines under load).
        self._reader.join(10)
        return rc

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def grab(self, pattern: str) -> list[re.Match]:
        """Every match in the whole output: ranks share one pipe, so their lines may interleave."""
        return list(re.finditer(pattern, self.output))


def final(proc: Proc) -> tuple[int, str]:
    """(final step, digest) printed by the example at the end of a complete run."""
    (match,) = proc.grab(r"final step=(\d+) digest=([0-9a-f]{64})")
    return int(match[1]), match[2]


def run_to_end(ckpt: Path, steps: int, *extra: str, env: dict[str, str], timeout: float = 90) -> Proc:
    proc = Proc.example(ckpt, steps, *extra, env=env)
    rc = proc.finish(timeout)
    assert rc == 0, proc.output
    return proc
