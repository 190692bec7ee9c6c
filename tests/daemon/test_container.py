"""The container image, built and run for real with podman: the daemon container beside a training
container, once sharing the network namespace (``tcp://127.0.0.1``) and once sharing a socket volume
(``ipc://``). Stopping the daemon's container makes the trainer save and exit 75; the image's
HEALTHCHECK reports healthy, and unhealthy once the daemon stops answering.

The image is built offline by ``scripts/build-image.sh`` from a wheelhouse made on this host, on a
Debian base made by mmdebstrap (no registry is reachable here), tagged by a hash of the sources so a
changed checkout is rebuilt: over the last full build with the same dependencies, by reinstalling
only spotguard's wheel. Containers use ``--network none`` (loopback only) and are removed by name.
``scripts/test`` installs podman, runc and mmdebstrap as root.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RUNC = shutil.which("runc") or "/usr/sbin/runc"
PODMAN = ["podman", "--runtime", RUNC, "--cgroup-manager", "cgroupfs"]
RUN = ["run", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
UID = 10001  # the image's user

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # the first test of a worker may build the image (minutes under load)
    pytest.mark.skipif(shutil.which("podman") is None or shutil.which("mmdebstrap") is None or os.geteuid(),
                       reason="needs root, podman and mmdebstrap (scripts/test installs them as root)"),
]


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result


def source_hash() -> str:
    digest = hashlib.sha256()
    paths = [ROOT / "pyproject.toml", ROOT / "deploy" / "docker" / "Dockerfile"]
    for top in ("client", "daemon", "examples"):
        paths += sorted(p for p in (ROOT / top).rglob("*.py"))
    for path in paths:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


@pytest.fixture(scope="module", autouse=True)
def containers_conf(tmp_path_factory):
    """``podman kube play`` takes no ``--ulimit``, and the default rlimits fail on this kind of VM: set
    them in a containers.conf of the test's own."""
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text('[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n')
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTAINERS_CONF", str(conf))
        yield


def deps_hash() -> str:
    """What the full build depends on besides spotguard's own code: its declared dependencies, the
    Dockerfile, the build script and the host's torch (build-image.sh pins the image's to it)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    digest = hashlib.sha256(json.dumps([project["dependencies"], project["optional-dependencies"],
                                        project["requires-python"], version("torch")]).encode())
    for path in (ROOT / "deploy" / "docker" / "Dockerfile", ROOT / "scripts" / "build-image.sh"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


THIN = """FROM {base}
USER root
COPY wheels /wheels
RUN /opt/spotguard/bin/pip install --no-cache-dir --no-index --no-deps --force-reinstall /wheels/*.whl \\
    && rm -rf /wheels
USER {uid}:{uid}
"""


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    """The image with torch (so one image serves the daemon and the trainer), built once per source.

    The full build (scripts/build-image.sh: the Dockerfile, torch and every dependency, minutes) runs
    once per :func:`deps_hash`; a source change only adds a thin layer over that image reinstalling
    spotguard's own wheel (seconds). The entrypoint, user, volumes and HEALTHCHECK are the Dockerfile's."""
    tag = f"localhost/spotguard-test:{source_hash()}"
    # One build for both pytest-xdist workers (test_daemonset_fresh_node shares this fixture): the
    # second waits on the lock, then finds the image.
    with open(f"/tmp/spotguard-test-image-{os.getuid()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if podman("image", "exists", tag, check=False).returncode != 0:
            base = f"localhost/spotguard-test-deps:{deps_hash()}"
            if podman("image", "exists", base, check=False).returncode != 0:
                env = {**os.environ, "ENGINE_ARGS": " ".join(PODMAN[1:])}
                subprocess.run([str(ROOT / "scripts" / "build-image.sh"), "--engine", "podman",
                                "--base-from-debian", "--extras", "torch", "--tag", base],
                               cwd=ROOT, env=env, check=True, timeout=1200)
                podman("tag", base, tag)  # built from these very sources: no layer to add
                return tag
            context = tmp_path_factory.mktemp("image")
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "--no-build-isolation", "--wheel-dir", str(context / "wheels"),
                            str(ROOT)], check=True, timeout=300)
            (context / "Containerfile").write_text(THIN.format(base=base, uid=UID))
            podman("build", "--format", "docker", "--tag", tag, str(context), timeout=600)
    return tag


@pytest.fixture
def containers():
    """``containers.run(name_suffix, *args)`` starts a detached container; all are removed by name."""
    names: list[str] = []

    class Containers:
        @staticmethod
        def run(*args: str) -> str:
            name = f"sg-test-{uuid.uuid4().hex[:8]}"
            names.append(name)
            podman(*RUN, "-d", "--name", name, *args)
            return name

    yield Containers
    for name in reversed(names):  # a trainer that joined the daemon's network namespace goes first
        podman("rm", "-f", "-t", "0", name, check=False)


def shared_dir(tmp_path: Path, name: str, mode: int) -> Path:
    path = tmp_path / name
    path.mkdir()
    os.chown(path, UID, UID)
    path.chmod(mode)
    return path


def wait_for(predicate, seconds: float, what: str) -> None:
    for _ in range(int(seconds * 5)):
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def trainer_args(ckpt: Path, image: str, env: dict[str, str]) -> list[str]:
    flags = [f"--env={k}={v}" for k, v in env.items()]
    return [*flags, "--user", f"{UID}:{UID}", "-v", f"{ckpt}:/checkpoints", "--entrypoint", "python",
            image, "-m", "spotguard_examples.train_plain", "--steps", "100000", "--step-sleep", "0.02",
            "--save-every", "25", "--ckpt-dir", "/checkpoints/job"]


def stop_daemon_and_expect_75(daemon: str, trainer: str, ckpt: Path) -> None:
    wait_for(lambda: (ckpt / "job" / "latest").exists(), 90, "the trainer's first checkpoint")
    podman("stop", "-t", "60", daemon, timeout=90)
    code = podman("wait", trainer, timeout=90).stdout.strip()
    logs = podman("logs", trainer, check=False).stdout + podman("logs", daemon, check=False).stderr
    assert code == "75", logs
    latest = (ckpt / "job" / "latest").read_text().strip()
    assert (ckpt / "job" / latest / "manifest.json").is_file(), latest


def test_sidecar_on_a_shared_loopback(image, containers, tmp_path):
    ckpt = shared_dir(tmp_path, "ckpt", 0o755)
    env = {"SPOTGUARD_ZMQ__PUB_ENDPOINT": "tcp://127.0.0.1:5555",
           "SPOTGUARD_ZMQ__REQUEST_ENDPOINT": "tcp://127.0.0.1:5556"}
    daemon = containers.run("--network", "none", *[f"--env={k}={v}" for k, v in env.items()],
                            "--env=SPOTGUARD_PLATFORM=none", "--env=SPOTGUARD_DELIVERY__SIGNAL=none",
                            "-v", f"{ckpt}:/checkpoints", image)
    trainer = containers.run("--network", f"container:{daemon}", *trainer_args(ckpt, image, env))
    stop_daemon_and_expect_75(daemon, trainer, ckpt)


def test_sidecar_on_a_shared_socket_volume(image, containers, tmp_path):
    ckpt, run = shared_dir(tmp_path, "ckpt", 0o755), shared_dir(tmp_path, "run", 0o700)
    daemon = containers.run("--network", "none", "--env=SPOTGUARD_PLATFORM=none",
                            "--env=SPOTGUARD_DELIVERY__SIGNAL=none", "-v", f"{run}:/run/spotguard",
                            "-v", f"{ckpt}:/checkpoints", image)
    wait_for(lambda: (run / "requests.sock").exists(), 30, "the daemon's ipc socket")
    env = {"SPOTGUARD_RUNTIME_DIR": "/run/spotguard"}
    trainer = containers.run("--network", "none", "-v", f"{run}:/run/spotguard",
                             *trainer_args(ckpt, image, env))
    stop_daemon_and_expect_75(daemon, trainer, ckpt)


def test_healthcheck_follows_the_daemon(image, containers, tmp_path):
    daemon = containers.run("--network", "none", "--env=SPOTGUARD_PLATFORM=none", image)
    wait_for(lambda: podman("healthcheck", "run", daemon, check=False).returncode == 0, 30,
             "a healthy daemon")
    pid = int(podman("inspect", "-f", "{{.State.Pid}}", daemon).stdout)
    os.kill(pid, signal.SIGSTOP)  # a hung daemon: alive, answering nothing
    try:
        result = podman("healthcheck", "run", daemon, check=False, timeout=60)
        assert result.returncode != 0 and "unhealthy" in result.stdout + result.stderr, result
    finally:
        os.kill(pid, signal.SIGCONT)
    size = int(podman("image", "inspect", "-f", "{{.Size}}", image).stdout)
    assert size < 3e9  # a CPU torch image; a CUDA torch slipping in would be several GB more


def sidecar_pod(image: str, ckpt: Path) -> dict:
    """deploy/kubernetes/training-job.yaml's pod, as podman 4 can play it: the native sidecar (an init
    container with restartPolicy: Always) becomes an ordinary container, the images are the test
    image, the trainer runs the bundled example, and the checkpoint volume is a host directory."""
    job = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "training-job.yaml").read_text())
    spec = job["spec"]["template"]["spec"]
    sidecar = {k: v for k, v in spec.pop("initContainers")[0].items() if k != "restartPolicy"}
    sidecar["env"] = [e for e in sidecar["env"] if e["name"] != "SPOTGUARD_STORAGE__URL"]
    sidecar["env"].append({"name": "SPOTGUARD_PLATFORM", "value": "none"})
    trainer = spec["containers"][0]
    trainer["command"] = ["python", "-m", "spotguard_examples.train_plain", "--steps", "100000",
                          "--step-sleep", "0.02", "--save-every", "25", "--ckpt-dir", "/checkpoints/job"]
    trainer.pop("resources")
    for container in (sidecar, trainer):
        container["image"] = image
    spec["containers"] = [sidecar, trainer]
    spec["volumes"] = [{"name": "checkpoints", "hostPath": {"path": str(ckpt), "type": "Directory"}},
                       *(v for v in spec["volumes"] if v["name"] != "checkpoints")]
    spec["restartPolicy"] = "Never"
    spec.pop("shareProcessNamespace")  # podman's `pod stop` ends the shared namespace's pid 1 (its infra
    # container) with the others, which kills every process left in it: Kubernetes keeps its pause
    # container until the last one exits
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"sg-test-{uuid.uuid4().hex[:8]}"},
            "spec": spec}


def test_kubernetes_sidecar_pod_saves_and_exits_75_when_the_pod_stops(image, tmp_path):
    ckpt = shared_dir(tmp_path, "ckpt", 0o755)
    pod = sidecar_pod(image, ckpt)
    name, manifest = pod["metadata"]["name"], tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(pod))
    podman("kube", "play", "--network", "none", str(manifest))
    try:
        wait_for(lambda: (ckpt / "job" / "latest").exists(), 90, "the trainer's first checkpoint")
        grace = str(pod["spec"]["terminationGracePeriodSeconds"])
        podman("pod", "stop", "-t", grace, name, timeout=90)  # what `kube down` does: SIGTERM, grace
        code = podman("inspect", "-f", "{{.State.ExitCode}}", f"{name}-trainer").stdout.strip()
        assert code == "75", podman("logs", f"{name}-trainer", check=False).stdout
        latest = (ckpt / "job" / "latest").read_text().strip()
        assert (ckpt / "job" / latest / "manifest.json").is_file()
    finally:
        podman("kube", "down", str(manifest), check=False)


def test_kubernetes_manifests_validate_against_the_api_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml")):
        for resource in yaml.safe_load_all(path.read_text()):
            for api_version in ("1.30.0", kubernetes_validate.latest_version()):  # native sidecars: 1.29+
                kubernetes_validate.validate(resource, api_version, strict=True)  # raises on any error
