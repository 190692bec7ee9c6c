"""Deployment files: the systemd unit passes ``systemd-analyze verify``; the Dockerfile's shape is
checked statically here (test_container.py builds and runs it with podman)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "spotguard.service"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def unit_keys() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            keys.setdefault(key.strip(), []).append(value.strip())
    return keys


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    # verify insists that ExecStart's binary exists: point it at this venv's entry point.
    spotguard = Path(sys.executable).parent / "spotguard"
    text = re.sub(r"(?m)^ExecStart=\S+", f"ExecStart={spotguard}", UNIT.read_text())
    copy = tmp_path / "spotguard.service"
    copy.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), result


def test_unit_is_a_hardened_notify_service_that_can_still_signal():
    keys = unit_keys()
    expected = {"Type": "notify", "Restart": "on-failure", "RuntimeDirectory": "spotguard",
                "RuntimeDirectoryMode": "0700", "StateDirectory": "spotguard",
                "NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes",
                "CapabilityBoundingSet": "CAP_KILL", "UMask": "0077"}
    for key, value in expected.items():
        assert keys.get(key) == [value], key
    assert keys["ExecStart"][0].endswith("spotguard daemon")
    assert "WatchdogSec" in keys and "ReadWritePaths" in keys
    for forbidden in ("PrivatePIDs", "ProtectProc", "IPAddressDeny", "PrivateNetwork"):
        assert forbidden not in keys, f"{forbidden} would cut the daemon off the metadata or the jobs"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if current:
                logical.append(current)
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "")
            for text in logical]


def test_dockerfile_runs_the_daemon_as_non_root_with_a_status_healthcheck():
    instructions = dockerfile_instructions()
    names = [name for name, _ in instructions]
    froms = [args for name, args in instructions if name == "FROM"]
    assert froms == ["${BASE}"] and "BASE=python:3.11-slim" in [a for n, a in instructions if n == "ARG"]
    users = [args for name, args in instructions if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert names.index("USER") > max(i for i, n in enumerate(names) if n == "RUN")
    health = dict(instructions)["HEALTHCHECK"]
    assert json.loads(health.split("CMD", 1)[1])[:2] == ["spotguard", "status"]
    assert json.loads(dict(instructions)["ENTRYPOINT"]) == ["spotguard", "daemon"]
    assert "EXPOSE" not in names
    runs = " ".join(args for name, args in instructions if name == "RUN")
    assert "pip install --no-cache-dir --no-index --find-links=/wheels" in runs  # offline build


def test_dockerfile_copies_only_what_exists_and_sets_private_dirs():
    instructions = dockerfile_instructions()
    for name, args in instructions:
        if name == "COPY":  # the context is scripts/build-image.sh's wheelhouse: wheels/ only
            assert args.split()[:-1] == ["wheels"], args
    runs = " ".join(args for name, args in instructions if name == "RUN")
    assert "chmod 0700 /run/spotguard /var/lib/spotguard" in runs
    env = " ".join(args for name, args in instructions if name == "ENV")
    assert "SPOTGUARD_RUNTIME_DIR=/run/spotguard" in env


def test_sidecar_readme_covers_both_setups():
    text = (ROOT / "deploy" / "docker" / "README.md").read_text()
    assert "tcp://127.0.0.1" in text and "SPOTGUARD_RUNTIME_DIR" in text and "shared volume" in text
