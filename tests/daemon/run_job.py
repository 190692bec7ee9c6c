"""A job that does not import spotguard, for ``spotguard run``'s tests.

    python run_job.py DIR [--finish-at N] [--wait] [--fail STATUS] [--grandchild] [--orphan]

Each launch appends its pid to ``DIR/launches`` (and ``$SPOTGUARD_FRESH`` or ``-`` to ``DIR/fresh``); launch ``N`` (1-based, default 2) and later exit 0
at once. Earlier ones trap SIGUSR1, SIGTERM and SIGINT, write ``DIR/ready-<launch>`` and sleep (30 s at
most, then exit 1). On a signal they write ``DIR/got-<launch>`` (the signal's name), wait for
``DIR/go-<launch>`` with ``--wait``, and exit 75, as a clean stop would. ``--fail S``: every launch
exits S. ``--grandchild``: a child that sleeps is started first, its pid in ``DIR/grandchild``.
``--orphan``: a process that lives 0.3 s and whose parent exits at once (so that it is reparented
to the supervisor when that is PID 1) is started first, its pid in ``DIR/orphan``.
"""

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("dir", type=Path)
parser.add_argument("--finish-at", type=int, default=2)
parser.add_argument("--wait", action="store_true")
parser.add_argument("--fail", type=int)
parser.add_argument("--grandchild", action="store_true")
parser.add_argument("--orphan", action="store_true")
args = parser.parse_args()
with open(args.dir / "launches", "a") as file:
    file.write(f"{__import__('os').getpid()}\n")
with open(args.dir / "fresh", "a") as file:  # $SPOTGUARD_FRESH as each launch saw it
    file.write(f"{__import__('os').environ.get('SPOTGUARD_FRESH', '-')}\n")
launch = len((args.dir / "launches").read_text().split())
if args.fail is not None:
    sys.exit(args.fail)
if launch >= args.finish_at:
    sys.exit(0)
if args.grandchild:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    (args.dir / "grandchild").write_text(str(child.pid))
if args.orphan:
    subprocess.run(["sh", "-c", f"sleep 0.3 & echo $! > {args.dir}/orphan"], check=True)
got: list[int] = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
(args.dir / f"ready-{launch}").write_text("ready")
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
if not got:
    sys.exit(1)
(args.dir / f"got-{launch}").write_text(signal.Signals(got[0]).name)
while args.wait and not (args.dir / f"go-{launch}").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(75)
