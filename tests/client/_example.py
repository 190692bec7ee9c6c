"""Launch ``examples/train_plain.py`` as a real subprocess and read its output line by line.

:meth:`Proc.example` forks each run from a JobServer (tests/client/_jobserver.py) that imported
torch once, instead of starting a fresh interpreter (torch and its first optimizer's imports: 3-9 s
a launch on two busy cores). Each run is still its own process with its own pid, argv,
environment and signal handlers; the servers are kept in a pool, one per run going at once.
"""

from __future__ import annotations

import atexit
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _jobserver import JobServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_plain.py"


def isolated_env(runtime: Path, **extra: str) -> dict[str, str]:
    """The environment for a child: its own runtime dir, so no daemon on this machine is reached."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(SPOTGUARD_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def example_args(ckpt: Path, steps: int, *extra: str) -> list[str]:
    return [str(EXAMPLE), "--steps", str(steps), "--ckpt-dir", str(ckpt), *extra]


_IDLE: queue.SimpleQueue[JobServer] = queue.SimpleQueue()
_SERVERS: list[JobServer] = []
atexit.register(lambda: [server.close() for server in _SERVERS])


class Forked:
    """What the tests use of a ``Popen``, for a run forked by an idle JobServer of the pool (a new
    one when every server has a run going). Its output goes to the file ``out``."""

    def __init__(self, argv: list[str], env: dict[str, str], out: Path) -> None:
        try:
            self._server = _IDLE.get_nowait()
        except queue.Empty:
            self._server = JobServer()
            _SERVERS.append(self._server)
        self.args, self.returncode = argv, None
        self.pid = self._server.start(argv, env, out)
        self._ended = threading.Event()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        code = self._server.wait()
        self.returncode = code
        self._ended.set()
        _IDLE.put(self._server)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # until reaped by its server, the pid is still this run's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Proc:
    """A child process whose merged stdout/stderr lines are collected by a reader thread."""

    def __init__(self, argv: list[str], env: dict[str, str], forked: bool = False, **popen: object) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        if forked:
            fd, out = tempfile.mkstemp(prefix="sg-example-", suffix=".out")
            os.close(fd)
            self.popen = Forked(argv, env, Path(out))
            self._reader = threading.Thread(target=self._tail, args=(Path(out),), daemon=True)
        else:
            # As a terminal starts a foreground job: SIGINT not ignored. A child inherits an ignored
            # SIGINT across exec (a test runner's worker may ignore it), and Python then leaves it
            # ignored, so a Ctrl-C test would see the job run on to its end.
            ignored = popen.get("start_new_session") and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            if ignored:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                self.popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True, **popen)
            finally:
                if ignored:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
            self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def example(cls, ckpt: Path, steps: int, *extra: str, env: dict[str, str], **popen: object) -> "Proc":
        """A run of the example job, forked from a warm JobServer; with ``popen`` arguments (a
        session of its own, to signal its process group as a terminal does) a fresh interpreter."""
        if popen:
            return cls([sys.executable, *example_args(ckpt, steps, *extra)], env, **popen)
        return cls(example_args(ckpt, steps, *extra), env, forked=True)

    def _read(self) -> None:
        for line in self.popen.stdout:
            self._line(line.rstrip("\n"))

    def _tail(self, out: Path) -> None:
        """Follow the forked run's output file until the run has ended and the file is read."""
        partial = ""
        with open(out, errors="replace") as file:
            while True:
                ended = self.popen.poll() is not None
                chunk = file.read()
                if chunk:
                    *lines, partial = (partial + chunk).split("\n")
                    for line in lines:
                        self._line(line)
                elif ended:
                    break
                else:
                    time.sleep(0.01)
        if partial:
            self._line(partial)
        out.unlink()

    def _line(self, line: str) -> None:
        self.lines.append(line)
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
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pid {self.popen.pid} still running {timeout} s later ({_where(self.popen.pid)}); "
                                 f"its output so far:\n{self.output}") from None
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


def _where(pid: int) -> str:
    """What a running process waits on, from /proc (its state, and the kernel function it sleeps in)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
    except (OSError, StopIteration):
        return "gone"
    return f"{state.split(':', 1)[1].strip()}, in {wchan or '?'}, {threads} threads"
