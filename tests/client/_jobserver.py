"""Run a job script many times as fresh processes without paying torch's import each time.

A small server process imports torch and NumPy once, then for each request forks a child that runs
the script as ``__main__`` with its own argv, environment and output file: every run is a separate
process (own RNGs, own workers, killable by pid), started from a template that only imported
libraries. On two busy cores this turns a 10 s start into a few milliseconds. The template also
imports ``torch._dynamo``, which constructing any torch.optim optimizer imports: without it every
run paid 1.3 s more (a life of tests/client/test_chaos.py reaches its first step in 0.15 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

_SERVER = r"""
import json, os, runpy, sys, traceback
import importlib, numpy, threading, time, torch  # the expensive imports, once
import torch._dynamo  # a run's first optimizer imports it (torch.optim): 1.3 s a run otherwise
for name in sys.argv[1:]:
    importlib.import_module(name)
def orphaned(parent=os.getppid()):  # the test process died without closing us: exit too
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)
threading.Thread(target=orphaned, daemon=True).start()
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.environ.clear(); os.environ.update(req["env"]); sys.argv = req["argv"]
        fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1); os.dup2(fd, 2)
        if os.environ.get("PYTHONUNBUFFERED"):  # as a fresh interpreter would: no line held back
            sys.stdout.reconfigure(line_buffering=True)
        code = 0
        try:
            runpy.run_path(req["argv"][0], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc(); code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class JobServer:
    """``start(argv, env, out)`` forks one run and returns its pid; ``wait()`` returns its status.
    ``preload`` names more modules for the template to import, e.g. ``torch._inductor``, which
    ``torch.use_deterministic_algorithms`` imports (with sympy: seconds a run)."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.running: int | None = None

    def start(self, argv: list[str], env: dict[str, str], out: Path) -> int:
        request = {"argv": argv, "env": env, "out": str(out)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        self.running = json.loads(self.proc.stdout.readline())["pid"]
        return self.running

    def wait(self) -> int:
        rc = json.loads(self.proc.stdout.readline())["rc"]
        self.running = None
        return rc

    def run(self, argv: list[str], env: dict[str, str], out: Path) -> int:
        self.start(argv, env, out)
        return self.wait()

    def close(self) -> None:
        """Stop the server; a run still going (a test failed while it ran) is SIGKILLed first."""
        if self.running is not None:
            try:
                os.kill(self.running, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
