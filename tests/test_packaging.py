"""The distribution ships every package directory, and `import spotguard` stays light."""

from __future__ import annotations

import subprocess
import sys
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


def test_importing_the_client_does_not_import_the_daemon_side_or_torch():
    code = ("import sys, spotguard, spotguard.protocol\n"
            "heavy = {'torch', 'httpx', 'prometheus_client', 'pydantic_settings', 'click', 'boto3',\n"
            "         'google.cloud.storage', 'azure.storage.blob', 'spotguard_daemon', 'numpy'}\n"
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
