"""The grace a pod gives after SIGTERM reaches both spotguard sides from the shipped manifests
(GKE Spot nodes may give up to 120 s): the daemon's ``signal.grace`` and the client's SIGTERM deadline
come from one variable, ``SPOTGUARD_SIGNAL__GRACE``, set below ``terminationGracePeriodSeconds``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = [ROOT / "deploy" / "kubernetes" / name for name in ("daemonset.yaml", "training-job.yaml",
                                                                    "multinode-job.yaml")]


def pod_spec(path: Path) -> dict:
    """The pod template of the manifest's workload (a DaemonSet or a Job)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") in ("DaemonSet", "Job")]
    return docs[0]["spec"]["template"]["spec"]


def grace_env(container: dict) -> float | None:
    values = [e["value"] for e in container.get("env", []) if e["name"] == "SPOTGUARD_SIGNAL__GRACE"]
    return float(values[0]) if values else None


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_spotguard_container_takes_its_grace_from_the_pod_spec_below_the_pods_own(path):
    spec = pod_spec(path)
    containers = [c for c in spec["containers"] + spec.get("initContainers", []) if c.get("env")]
    graces = {c["name"]: grace_env(c) for c in containers}
    assert graces and all(g is not None for g in graces.values()), graces  # the trainer's too
    assert len(set(graces.values())) == 1, graces  # one value for the daemon and the client
    assert 0 < next(iter(graces.values())) <= spec["terminationGracePeriodSeconds"] - 5


def test_the_daemon_reads_the_manifests_grace(tmp_path):
    spec = pod_spec(MANIFESTS[1])
    sidecar = spec["initContainers"][0]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           **{e["name"]: e["value"] for e in sidecar["env"] if "value" in e},
           "SPOTGUARD_RUNTIME_DIR": str(tmp_path / "run"), "SPOTGUARD_STATE_DIR": str(tmp_path / "state")}
    result = subprocess.run([sys.executable, "-m", "spotguard_daemon", "daemon", "--print-config"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["signal"]["grace"] == grace_env(sidecar)


CLIENT = """
import os, signal, time
import spotguard
guard = spotguard.Guard(daemon=False, force_exit=False)
print("ready", flush=True)
while not guard.stop_requested:
    time.sleep(0.01)
print(round(guard.seconds_left()), flush=True)
"""


@pytest.mark.parametrize("grace, expected", [("110", 110), (None, 30)])
def test_a_clients_sigterm_deadline_follows_the_variable(grace, expected):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    if grace is not None:
        env["SPOTGUARD_SIGNAL__GRACE"] = grace  # GKE Spot with 120 s of graceful shutdown
    proc = subprocess.Popen([sys.executable, "-c", CLIENT], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert abs(int(proc.stdout.readline()) - expected) <= 1
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_grace_that_is_not_a_number_is_refused_in_one_line():
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
           "SPOTGUARD_SIGNAL__GRACE": "two minutes"}
    result = subprocess.run([sys.executable, "-c", "import spotguard; spotguard.Guard(daemon=False)"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "SPOTGUARD_SIGNAL__GRACE='two minutes' is not a number" in result.stderr
