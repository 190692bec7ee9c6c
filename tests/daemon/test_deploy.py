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
    bases = [a for n, a in instructions if n == "ARG" and a.startswith("BASE=")]
    assert froms == ["${BASE}"] and len(bases) == 1
    assert re.fullmatch(r"BASE=python:3\.11-slim@sha256:[0-9a-f]{64}", bases[0]), "pin the base by digest"
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


KUBERNETES = ROOT / "deploy" / "kubernetes"


def pod_spec(name: str, kind: str) -> dict:
    import yaml

    resource = next(r for r in yaml.safe_load_all((KUBERNETES / name).read_text()) if r["kind"] == kind)
    return resource["spec"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_daemonset_owns_its_host_directories_before_the_daemon_starts():
    """hostPath DirectoryOrCreate makes root-owned 0755 directories: an init container (root with
    CHOWN and FOWNER only) gives every hostPath volume to the pods' uid, 0700, before the daemon runs
    (test_daemonset_fresh_node.py plays it with podman)."""
    spec = pod_spec("daemonset.yaml", "DaemonSet")
    uid = spec["securityContext"]["runAsUser"]
    host = {v["name"] for v in spec["volumes"] if "hostPath" in v}
    (init,) = spec["initContainers"]
    mounted = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert set(mounted) == host
    command = init["command"]
    assert command[:2] == ["sh", "-c"] and set(mounted.values()) <= set(command[3:])
    assert "chmod 0700" in command[2] and f"chown {uid}:{uid}" in command[2]
    assert command[2].index("chmod") < command[2].index("chown")
    context = init["securityContext"]
    assert context["runAsUser"] == 0 and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}


def test_the_daemonset_serves_metrics_on_its_own_address_and_no_tcp_request_endpoint():
    spec = pod_spec("daemonset.yaml", "DaemonSet")
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    (daemon,) = spec["containers"]
    env = env_of(daemon)
    assert env["SPOTGUARD_METRICS__HOST"] == "$(POD_IP)"
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert [e["name"] for e in daemon["env"]].index("POD_IP") < [e["name"] for e in daemon["env"]].index(
        "SPOTGUARD_METRICS__HOST"), "$(POD_IP) expands only a variable defined before it"
    for name in ("SPOTGUARD_ZMQ__PUB_ENDPOINT", "SPOTGUARD_ZMQ__REQUEST_ENDPOINT"):
        assert env[name].startswith("ipc:///run/spotguard/"), "allow_remote must not open tcp://"
    context = daemon["securityContext"]
    assert context == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                       "capabilities": {"drop": ["ALL"]}}


def test_the_training_job_runs_unprivileged_without_a_service_account_token():
    spec = pod_spec("training-job.yaml", "Job")
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (sidecar,), (trainer,) = spec["initContainers"], spec["containers"]
    for container in (sidecar, trainer):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    env = env_of(sidecar)  # an emptyDir is 0777: the daemon's own directories are made inside it
    mounts = {m["mountPath"] for m in sidecar["volumeMounts"]}
    for name in ("SPOTGUARD_RUNTIME_DIR", "SPOTGUARD_STATE_DIR"):
        assert Path(env[name]).parent.as_posix() in mounts, name


def test_the_multinode_job_runs_one_pod_per_node_each_with_its_daemon_and_one_job_id():
    """Node-local mode on Kubernetes: an indexed Job whose pod k is node rank k, rendezvous at pod 0
    through the headless Service that is the pods' subdomain, one pod per node, the checkpoint root
    on the pod's own disk, the bucket given to each pod's daemon, one job id everywhere, and exit
    75, 76 and 77 not counted as failures (torchrun's 1 is read by `spotguard run`)."""
    import yaml

    resources = {r["kind"]: r for r in yaml.safe_load_all((KUBERNETES / "multinode-job.yaml").read_text())}
    service, job = resources["Service"], resources["Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    (rule,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    (sidecar,), (trainer,) = pod["initContainers"], pod["containers"]
    assert sidecar["restartPolicy"] == "Always" and env_of(sidecar)["SPOTGUARD_STORAGE__URL"].startswith("s3://")
    command = trainer["command"]
    assert command[:4] == ["spotguard", "run", "--", "torchrun"]
    assert "--nnodes=2" in command and "--node-rank=$(JOB_COMPLETION_INDEX)" in command
    assert f"--master-addr={job['metadata']['name']}-0.{pod['subdomain']}" in command
    env = env_of(trainer)
    names = [e["name"] for e in trainer["env"]]
    assert names.index("JOB_COMPLETION_INDEX") == 0 and env["SPOTGUARD_JOB_ID"] == job["metadata"]["name"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (root,) = [m["name"] for m in trainer["volumeMounts"] if m["mountPath"] == "/checkpoints"]
    assert "emptyDir" in volumes[root]  # the node's own disk, never a shared volume
    ignored = [r["onExitCodes"]["values"] for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r]
    assert ignored == [[75, 76, 77]]


@pytest.mark.parametrize("name", ["training-job.yaml", "multinode-job.yaml"])
def test_the_sidecar_manifests_reach_the_daemon_over_ipc_as_proven_clients(name):
    """tcp:// proves no client (never signalled, no goodput): the sidecar and the trainer share the
    daemon's runtime directory in one volume, one uid (the pod's) and one PID namespace."""
    spec = pod_spec(name, "Job")
    assert spec["shareProcessNamespace"] is True and spec["securityContext"]["runAsUser"] == 10001
    (sidecar,), (trainer,) = spec["initContainers"], spec["containers"]
    for container in (sidecar, trainer):
        env = env_of(container)
        assert not any(str(v).startswith("tcp://") for v in env.values()), container["name"]
        assert "SPOTGUARD_DELIVERY__SIGNAL" not in env and "runAsUser" not in container["securityContext"]
    runtime = env_of(sidecar)["SPOTGUARD_RUNTIME_DIR"]
    assert env_of(trainer)["SPOTGUARD_RUNTIME_DIR"] == runtime
    mounts = [{m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (sidecar, trainer)]
    parent = Path(runtime).parent.as_posix()
    assert mounts[0][parent] == mounts[1][parent]
    assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}[mounts[0][parent]]
