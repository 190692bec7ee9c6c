"""kill -9 at any instant of an emergency save (``save(blocking=True)``, written from live memory by
several threads) leaves the previous or the new checkpoint loadable, and no partial step dir: the
trials of test_checkpoint_crash.py (a forked child killed at random, or by itself right before/after
a chosen system call) with the emergency path's own calls (``pwrite`` of a segment from any thread,
the per-file fsyncs, the rename, the ``latest`` replace)."""

from __future__ import annotations

import random

import pytest

from test_checkpoint_crash import crash_trials

HOOKS = [(name, nth, after) for name, nth in [("pwrite", 1), ("pwrite", 3), ("fsync", 2), ("fsync", 5),
                                              ("rename", 1), ("replace", 1), ("replace", 2)]
         for after in (False, True)]


@pytest.mark.slow
def test_sigkill_mid_emergency_save_leaves_a_loadable_checkpoint(tmp_path, caplog):
    crash_trials(tmp_path, caplog, HOOKS, random.Random(4321), 24, blocking=True)
