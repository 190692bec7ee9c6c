"""The distribution ships every package directory (light imports: tests/client/test_public_api.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = {name: ROOT / path for name, path in config["package-dir"].items() if name}
    found = set()
    for top in ("client", "daemon"):
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(ROOT / top).parts))
    found.add("spotguard_examples")
    assert found == listed
    assert all(path.is_dir() for path in dirs.values())

