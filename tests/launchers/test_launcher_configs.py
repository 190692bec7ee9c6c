"""The SkyPilot and dstack templates (deploy/skypilot, deploy/dstack) load with the launchers' own
parsers, and the commands the nodes would run are spotguard's: a daemon in the background on each
node, `spotguard run -- torchrun` with the launcher's node rank, node count and rendezvous host, the
bucket as a durable-store URL, the checkpoint root on node-local disk and never a bucket mount.

SkyPilot's parser is `sky.Task.from_yaml` (PyPI `skypilot`; needs no credentials or API server).
skypilot 0.14.1 requires click<8.2 and huggingface-hub 2.x click>=8.4.2, so it lives in a venv of
its own (`scripts/test` makes `.venv-sky`; `$SKY_TEST_PYTHON` names its python), and the
parser runs there, in a subprocess that prints what the test checks as JSON.
dstack has no public parser for a configuration file: `parse_run_configuration` from
`dstack._internal.core.models.configurations` is what its CLI's `dstack apply` uses (no server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
BUCKET_SCHEMES = ("s3://", "gs://", "az://")


def _check_script(script: str, *, rank: str, nodes: str, master: str) -> None:
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # it parses as bash
    daemon = next(line for line in script.splitlines() if "spotguard daemon" in line)
    assert "--checkpoint-root \"$CKPT_DIR\"" in daemon
    assert script.index("spotguard daemon") < script.index("spotguard run -- torchrun")
    between = script[script.index("spotguard daemon"):script.index("spotguard run")]
    assert "&\n" in between or "& }" in between  # in the background
    for var in (rank, nodes, master):
        assert var in script, var


LOAD_TASK = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
(resources,) = task.resources
print(json.dumps({"num_nodes": task.num_nodes, "use_spot": resources.use_spot,
                  "job_recovery": resources.job_recovery, "envs": dict(task.envs),
                  "file_mounts": task.file_mounts, "storage_mounts": list(task.storage_mounts or {}),
                  "setup": task.setup, "run": task.run, "sky": sky.__version__}))
"""


def _sky_python() -> str:
    """A python that imports ``sky``: this one, ``$SKY_TEST_PYTHON``, or ``.venv-sky``'s."""
    candidates = [sys.executable, os.environ.get("SKY_TEST_PYTHON", ""),
                  str(DEPLOY.parent / ".venv-sky" / "bin" / "python")]
    for python in filter(None, candidates):
        if Path(python).exists() and subprocess.run([python, "-c", "import sky"], capture_output=True).returncode == 0:
            return python
    pytest.skip("skypilot is not installed (scripts/test installs it into .venv-sky)")


@pytest.mark.parametrize("name, nodes", [("train.yaml", 1), ("train-multinode.yaml", 2)])
def test_skypilot_templates_load_with_skypilot(name: str, nodes: int) -> None:
    done = subprocess.run([_sky_python(), "-c", LOAD_TASK, str(DEPLOY / "skypilot" / name)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    task = json.loads(done.stdout.strip().splitlines()[-1])
    assert task["sky"] == "0.14.1"  # the version the extra pins
    assert task["num_nodes"] == nodes
    assert task["use_spot"]
    assert task["job_recovery"]["max_restarts_on_errors"] >= 1  # exit 75 on a cancelled notice
    envs = task["envs"]
    assert envs["SPOTGUARD_STORAGE__URL"].startswith(BUCKET_SCHEMES)
    assert envs["SPOTGUARD_JOB_ID"]
    # no bucket mounted anywhere, least of all as (or above) the checkpoint root
    assert not task["file_mounts"] and not task["storage_mounts"]
    assert not envs["CKPT_DIR"].startswith(BUCKET_SCHEMES)
    assert "pip install 'spotguard[" in task["setup"]
    if nodes == 1:
        assert "--standalone" in task["run"]
    else:
        _check_script(task["run"], rank="$SKYPILOT_NODE_RANK", nodes="$SKYPILOT_NUM_NODES",
                      master="$SKYPILOT_NODE_IPS")
    subprocess.run(["bash", "-n"], input=task["run"], text=True, check=True)


def test_dstack_task_validates_with_dstack_models() -> None:
    pytest.importorskip("dstack")
    from dstack._internal.core.models.configurations import TaskConfiguration, parse_run_configuration

    data = yaml.safe_load((DEPLOY / "dstack" / "train.dstack.yml").read_text())
    conf = parse_run_configuration(data)
    assert isinstance(conf, TaskConfiguration)
    assert conf.nodes == 2 and conf.spot_policy.value == "spot"
    assert {e.value for e in conf.retry.on_events} >= {"interruption"}
    env = dict(conf.env.as_dict())
    assert env["SPOTGUARD_STORAGE__URL"].startswith(BUCKET_SCHEMES)
    assert not conf.volumes  # no bucket or volume mounted as the checkpoint root
    _check_script(_dstack_joined(conf.commands), rank="$DSTACK_NODE_RANK", nodes="$DSTACK_NODES_NUM",
                  master="$DSTACK_MASTER_NODE_IP")


def _dstack_joined(commands: list[str]) -> str:
    """One shell line, as dstack's server joins a task's commands (`_join_shell_commands` in
    dstack._internal.server.services.jobs.configurators.base, not importable without the server's
    dependencies): ' && ' between them, a command ending in '&' wrapped in '{ ... }'."""
    return " && ".join("{ %s }" % c.strip() if c.strip().endswith("&") else c.strip() for c in commands)
