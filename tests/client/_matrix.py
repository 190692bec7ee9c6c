"""One seed per test run for sampled end-to-end matrices (the expensive cells run a few per run).

``$SPOTGUARD_MATRIX_SEED`` repeats a run's choice; without it the seed is derived from
pytest-xdist's run id, the same in every worker of one run (so a run samples exactly what it says),
or drawn afresh. ``$SPOTGUARD_MATRIX_ALL=1`` runs every cell. Tests print the seed they used.
"""

from __future__ import annotations

import hashlib
import os
import random

__all__ = ["SEED", "ALL", "sample"]


def _seed() -> int:
    given, run_id = _GIVEN.get("SPOTGUARD_MATRIX_SEED"), os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if given:
        return int(given)
    if run_id:
        return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:4], "big") >> 2
    return random.SystemRandom().randrange(1 << 30)


_GIVEN = {name: os.environ.pop(name) for name in ("SPOTGUARD_MATRIX_SEED", "SPOTGUARD_MATRIX_ALL")
          if name in os.environ}
"""Taken out of the environment when this module is imported (at collection, before any test runs):
the daemons the tests start refuse a ``SPOTGUARD_*`` variable that names no setting."""
SEED = _seed()
ALL = _GIVEN.get("SPOTGUARD_MATRIX_ALL") == "1"


def sample(name: str, cells: list, count: int) -> set:
    """``count`` of ``cells`` (all of them with ``$SPOTGUARD_MATRIX_ALL=1``), chosen by :data:`SEED`
    and the matrix's ``name``."""
    return set(cells) if ALL else set(random.Random(f"{SEED}-{name}").sample(cells, min(count, len(cells))))


def skip_reason() -> str:
    return f"not sampled this run (SPOTGUARD_MATRIX_SEED={SEED}; SPOTGUARD_MATRIX_ALL=1 runs all)"
