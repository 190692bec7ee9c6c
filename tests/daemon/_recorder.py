"""A real child process that records the SIGUSR1 it gets, for the delivery tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Sequence

SCRIPT = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
tmp = out.with_name(out.name + ".tmp")  # written whole, then renamed: a reader never sees it empty
signal.signal(signal.SIGUSR1, lambda *a: (tmp.write_text("usr1"), tmp.replace(out)))
print("ready", flush=True)
time.sleep(60)
"""


def start_recorder(out: Path, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """A process that writes ``usr1`` into ``out`` when it gets SIGUSR1, started and ready (its
    handler is installed); the caller stops it."""
    proc = subprocess.Popen([*prefix, sys.executable, "-c", SCRIPT, str(out)], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    return proc
