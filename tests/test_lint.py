"""Pyflakes' checks and syntax errors (the selection in pyproject.toml) hold everywhere: an unused
import, an undefined name or an import a loop variable shadows fails here, not in a user's run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing_in_the_code_the_tests_and_the_benchmarks():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: it is in the test extra (pip install -e '.[test]')")
    paths = [p for p in ("client", "daemon", "tests", "benchmarks", "scripts", "examples") if (REPO / p).exists()]
    done = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", *paths], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
