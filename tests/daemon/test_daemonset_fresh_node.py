"""deploy/kubernetes/daemonset.yaml on a fresh node, played by ``podman kube play``: its hostPath
directories exist as the kubelet's ``DirectoryOrCreate`` makes them (root-owned, 0755). The init
container gives them to uid 10001 (0700), the daemon starts on them, and a training container of
uid 10001 beside it reaches the daemon over the shared socket directory and writes a checkpoint.

The pod is the DaemonSet's template as podman 4 can play it without a cluster: the images are the
test image, host networking and the downward-API address give way to ``--network none`` and
loopback metrics, and the probes and resources are left out. Shares the image, podman set-up and
helpers of test_container.py.
"""

from __future__ import annotations

import stat
import time
import uuid
from pathlib import Path

import yaml
from test_container import ROOT, UID, containers, containers_conf, image, podman, wait_for  # noqa: F401
from test_container import pytestmark  # noqa: F401 (root, podman and mmdebstrap; slow)

DAEMONSET = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"


def daemonset_pod(image: str, host: dict[str, Path]) -> dict:
    """The DaemonSet's pod, its hostPath volumes moved under ``host`` (volume name -> directory)."""
    daemonset = next(d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d["kind"] == "DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    for key in ("hostNetwork", "dnsPolicy", "priorityClassName", "tolerations"):
        spec.pop(key)
    for container in spec["initContainers"] + spec["containers"]:
        container["image"] = image
        for key in ("livenessProbe", "resources", "ports"):
            container.pop(key, None)
    daemon = spec["containers"][0]
    daemon["env"] = [e for e in daemon["env"] if e["name"] not in ("POD_IP", "SPOTGUARD_METRICS__HOST")]
    daemon["env"] += [{"name": "SPOTGUARD_PLATFORM", "value": "none"},
                      {"name": "SPOTGUARD_METRICS__HOST", "value": "127.0.0.1"}]
    for volume in spec["volumes"]:
        assert volume["hostPath"]["type"] == "DirectoryOrCreate", volume
        volume["hostPath"]["path"] = str(host[volume["name"]])
    # podman keeps an "always" init container after it exits instead of removing it at once, where
    # podman 4.3 under load may find runc still reporting it running and fail the whole play.
    metadata = {"name": f"sg-test-{uuid.uuid4().hex[:8]}",
                "annotations": {"io.podman.annotations.init.container.type": "always"}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def play(manifest: Path) -> None:
    """``podman kube play``, again after podman 4.3's race under load: it removes an init container
    right after it exited and may find runc still reporting it running ("cannot remove container ...
    as it is running")."""
    for attempt in range(6):
        result = podman("kube", "play", "--network", "none", str(manifest), check=False)
        if result.returncode == 0 or "cannot remove container" not in result.stderr:
            break
        podman("kube", "down", str(manifest), check=False)
        time.sleep(1 + attempt)  # let runc see the init container gone before playing again
    assert result.returncode == 0, result.stderr


def test_the_daemonset_starts_on_root_owned_0755_host_directories(image, containers, tmp_path):
    host = {name: tmp_path / name for name in ("run", "state", "checkpoints")}
    for path in host.values():  # as the kubelet makes them on a fresh node
        path.mkdir()
        path.chmod(0o755)
        assert path.stat().st_uid == 0
    pod = daemonset_pod(image, host)
    name, manifest = pod["metadata"]["name"], tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(pod))
    try:
        play(manifest)
        def logs() -> str:
            return podman("logs", f"{name}-spotguard", check=False).stderr

        wait_for(lambda: (host["run"] / "requests.sock").exists() or "belongs to uid" in logs(), 60,
                 "the daemon's socket")
        assert (host["run"] / "requests.sock").exists(), logs()
        for path in host.values():
            info = path.stat()
            assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (UID, UID, 0o700), path
        trainer = containers.run(
            "--network", "none", "--user", f"{UID}:{UID}", "-v", f"{host['run']}:/run/spotguard",
            "-v", f"{host['checkpoints']}:/checkpoints", "--entrypoint", "sh", image, "-c",
            "spotguard status && mkdir /checkpoints/job && echo saved > /checkpoints/job/step-1")
        code = podman("wait", trainer, timeout=90).stdout.strip()
        assert code == "0", podman("logs", trainer, check=False).stdout + podman("logs", trainer,
                                                                                 check=False).stderr
        assert (host["checkpoints"] / "job" / "step-1").read_text() == "saved\n"
        assert "pending notices: none" in podman("logs", trainer).stdout
    finally:
        podman("kube", "down", str(manifest), check=False)
