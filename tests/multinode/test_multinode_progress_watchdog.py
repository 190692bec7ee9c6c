"""The progress watchdog under ``Run(peer_timeout=)``: ``Watchdog.reset`` moves the forced exit
later at every step boundary, so only a process that stops reaching boundaries is ended (77)."""

from __future__ import annotations

import os
import subprocess
import sys

from spotguard import _record

CODE = """
import time
from spotguard._record import Recorder
from spotguard._watchdog import Watchdog
record = Recorder()
w = Watchdog(77, "no step boundary for 1 s", before_exit=lambda: record.emit("peer_lost", step=15, error="x"))
for _ in range(15):                      # 1.5 s of boundaries 0.1 s apart: never fires
    w.reset(time.monotonic() + 1.0)
    time.sleep(0.1)
print("alive", flush=True)
{tail}
"""


def run(tail: str, record=None) -> subprocess.CompletedProcess:
    env = {**os.environ, _record.ENV: str(record)} if record else None
    return subprocess.run([sys.executable, "-c", CODE.format(tail=tail)], capture_output=True, text=True,
                          timeout=60, env=env)


def test_a_process_that_keeps_reaching_boundaries_is_left_alone_and_one_that_stops_is_ended(tmp_path):
    hung = run("time.sleep(30)", tmp_path / "record.jsonl")  # no boundary any more: ended 1 s after the last
    assert hung.returncode == 77 and hung.stdout == "alive\n"
    assert "spotguard: no step boundary for 1 s; forced exit 77" in hung.stderr
    assert "most recent call first" in hung.stderr  # every thread's stack, for the user
    # before_exit ran, in the watchdog's thread, while the main thread was still blocked
    assert [(e["event"], e["step"]) for e in _record.read(tmp_path / "record.jsonl")] == [("peer_lost", 15)]


def test_an_earlier_reset_takes_effect_and_disarm_stops_it():
    sooner = run("w.reset(time.monotonic() + 60)\nw.reset(time.monotonic() + 0.2)\ntime.sleep(30)")
    assert sooner.returncode == 77
    disarmed = run("w.disarm()\ntime.sleep(2)\nprint('done')")
    assert disarmed.returncode == 0 and disarmed.stdout == "alive\ndone\n"
