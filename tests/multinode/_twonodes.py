"""Several "nodes" on one machine: network namespaces on one link, each with its own daemon.

A multi-node job needs what a cluster gives it: separate network stacks that reach each other over
a link, one spotguard daemon per node (its own runtime directory, sockets and state), and one
``torchrun`` agent per node meeting through c10d rendezvous. Each node here is a network namespace
(``ip netns add``) with loopback up and one end of a veth pair, addressed ``10.213.0.<n>/24``. Two
nodes are joined by their veth pair directly; three or more each plug their pair's other end into a
bridge inside a namespace of its own (the switch). Those addresses exist only inside the
namespaces, so nothing outside can reach them and parallel test runs (other namespaces) cannot
collide. ``link_mbit`` shapes every node's egress with ``tc`` (a token bucket at that rate), the
way a cluster's NICs bound node-to-node copies. The file system is shared, like a cluster's shared
checkpoint directory; with ``node_local`` each node's checkpoint root is a tmpfs of its own,
mounted here and unmounted at teardown, and the store is the S3 emulator reached through relays in
node a's namespace (``_bucket.py``).

Needs root and ``ip`` (CI runs as root); skips loudly otherwise. Every process started in a
namespace is killed by pid (``ip netns pids``) and the namespaces are deleted at teardown.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

from spotguard import _record

HERE = Path(__file__).parent
JOB = HERE / "_multinode_job.py"
SUBNET = "10.213.0"
_counter = itertools.count()


LETTERS = "abcdefgh"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def shape(netns: str, ifname: str, mbit: int) -> None:
    """Cap ``ifname``'s egress in ``netns`` at ``mbit`` Mbit/s: a token bucket (``tc qdisc ... tbf``)
    with a burst of 1 ms at that rate (at least 64 KiB) and 50 ms of queue."""
    burst = max(65536, mbit * 1000 // 8)
    subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", ifname, "root", "tbf",
                    "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"],
                   check=True, capture_output=True, timeout=10)


def netns_available() -> str | None:
    """Why two-node tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    return None


class Node:
    """One namespace: its address, its daemon and the processes started in it."""

    def __init__(self, name: str, index: int, workdir: Path, sock_dir: Path) -> None:
        self.name, self.index = name, index
        self.addr = f"{SUBNET}.{index + 1}"
        self.ifname = f"{name}v"
        self.runtime_dir, self.state_dir = sock_dir / name, workdir / f"state-{name}"
        self.log_dir = workdir
        self.extra_env: dict[str, str] = {}
        """Set in every process of this node, the daemon's included (e.g. the store's URL)."""
        self.daemon: subprocess.Popen | None = None
        self.relay: Any = None
        """This node's relay to the bucket (``_bucket.py``), when the store is one."""
        self.procs: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process on this node: its own daemon, gloo on its own link."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "TORCHELASTIC_"))}
        env.update(SPOTGUARD_RUNTIME_DIR=str(self.runtime_dir), GLOO_SOCKET_IFNAME=self.ifname,
                   SPOTGUARD_ZMQ__HEARTBEAT_INTERVAL="0.2", PYTHONUNBUFFERED="1", **self.extra_env, **extra)
        return env

    def popen(self, argv: list[str], log: Path, **env: str) -> subprocess.Popen:
        """``ip netns exec`` (which execs: the pid is the command's) in a session of its own."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], env=self.env(**env),
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_daemon(self, checkpoint_root: Path, timeout: float = 30.0) -> None:
        argv = [sys.executable, "-m", "spotguard_daemon", "daemon", "--platform", "none",
                "--runtime-dir", str(self.runtime_dir), "--state-dir", str(self.state_dir),
                "--checkpoint-root", str(checkpoint_root), "--metrics-port", "0"]
        self.daemon = self.popen(argv, self.log_dir / f"daemon-{self.name}.log")
        deadline = time.monotonic() + timeout
        while not (self.runtime_dir / "requests.sock").exists():
            assert self.daemon.poll() is None, self.daemon_log()
            assert time.monotonic() < deadline, f"daemon on {self.name} did not start: {self.daemon_log()}"
            time.sleep(0.1)

    def start_fresh_daemon(self, checkpoint_root: Path) -> None:
        """Node c in this namespace: a new daemon with an empty state, runtime directory and root."""
        self.runtime_dir = self.runtime_dir.with_name(self.runtime_dir.name + "c")
        self.state_dir = self.state_dir.with_name(self.state_dir.name + "c")
        self.start_daemon(checkpoint_root)

    def daemon_log(self) -> str:
        path = self.log_dir / f"daemon-{self.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def notify(self, deadline: float) -> None:
        """``spotguard notify`` against this node's daemon only."""
        out = subprocess.run(["ip", "netns", "exec", self.name, sys.executable, "-m", "spotguard_daemon",
                              "notify", "--kind", "drill", "--deadline", str(deadline), "--timeout", "10"],
                             env=self.env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=10)
        return [int(p) for p in out.stdout.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process in the namespace (daemon included), by pid; returns them."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def link_down(self) -> None:
        """Take this node off the network: its peers get no reset, their packets just vanish."""
        _ip("-n", self.name, "link", "set", self.ifname, "down")

    def link_up(self) -> None:
        _ip("-n", self.name, "link", "set", self.ifname, "up")


class Cluster:
    """The nodes and the commands that launch a job on all of them."""

    def __init__(self, workdir: Path, sock_dir: Path, count: int = 2, link_mbit: int | None = None) -> None:
        tag = f"sg{os.getpid() % 100000}{next(_counter)}"
        self.nodes = [Node(f"{tag}{c}", i, workdir, sock_dir) for i, c in enumerate(LETTERS[:count])]
        self.switch = f"{tag}s" if count > 2 else None
        self.link_mbit = link_mbit
        self.workdir, self.port = workdir, 29400 + next(_counter)
        self.checkpoint_root = workdir / "ckpt"
        self.checkpoint_root.mkdir(parents=True, exist_ok=True)
        self.mounts = ExitStack()

    def tmpfs(self, path: Path) -> Path:
        """A tmpfs of its own mounted on ``path`` (a node's local disk), unmounted at teardown."""
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0700", "tmpfs", str(path)],
                       check=True, capture_output=True, timeout=10)
        self.mounts.callback(subprocess.run, ["umount", str(path)], check=True, capture_output=True, timeout=10)
        return path

    def create(self) -> None:
        for node in self.nodes:
            _ip("netns", "add", node.name)
            _ip("-n", node.name, "link", "set", "lo", "up")
        if self.switch is None:
            a, b = self.nodes
            _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        else:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for node in self.nodes:
                _ip("link", "add", node.ifname, "type", "veth", "peer", "name", f"{node.ifname}p")
                _ip("link", "set", f"{node.ifname}p", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"{node.ifname}p", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"{node.ifname}p", "up")
        for node in self.nodes:
            _ip("link", "set", node.ifname, "netns", node.name)
            _ip("-n", node.name, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            _ip("-n", node.name, "link", "set", node.ifname, "up")
            if self.link_mbit:
                shape(node.name, node.ifname, self.link_mbit)

    def destroy(self) -> None:
        for node in self.nodes:
            node.kill_all()
        for node in self.nodes:
            for proc in node.procs:
                proc.wait(30)  # reap them: every one was in the namespace, so it was killed
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True, timeout=10)
        if self.switch is not None:
            subprocess.run(["ip", "netns", "del", self.switch], capture_output=True, timeout=10)
        self.mounts.close()

    def torchrun(self, node: Node, name: str, ckpt: str, record: Path, *job_args: str,
                 nproc: int = 1, run_id: str = "job", restarts: int = 0, rdzv_conf: str = "",
                 root: Path | None = None) -> "Launch":
        """One torchrun agent on ``node`` for a multi-node job (rendezvous on node a's address).

        ``is_host`` says which agent serves the rendezvous store: torchrun decides it by matching
        the endpoint against the machine's hostname, and all namespaces share this machine's."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(self.nodes)),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.nodes[0].addr}:{self.port}", "--rdzv-id", run_id,
                "--rdzv-conf", ",".join(filter(None, [f"is_host={int(node.index == 0)}", rdzv_conf])),
                "--local-addr", node.addr, "--max-restarts", str(restarts), "--monitor-interval", "0.5",
                str(JOB), "--ckpt-dir", str((root or self.checkpoint_root) / ckpt), *job_args]
        log = self.workdir / f"{name}-{node.name}.log"
        # One job id per checkpoint directory: the daemons' durable stores are keyed by job id, and
        # a relaunch restores a newer durable checkpoint of its job, so a reference run sharing the
        # id could hand the relaunch its own final step (CI once saw a relaunch resume from 80).
        proc = node.popen(argv, log, SPOTGUARD_RECORD=str(record), SPOTGUARD_JOB_ID=f"multinode-{ckpt}")
        return Launch(proc, log)

    def launch(self, name: str, ckpt: str, *job_args: str, nproc: int = 1,
               roots: list[Path] | None = None, **agent: Any) -> "Job":
        """The identical command on every node, checkpointing to the shared ``checkpoint_root /
        ckpt`` (``roots``: each node's own root instead); the record is shared too (one file, whole
        ``O_APPEND`` lines)."""
        record = self.workdir / f"{name}.jsonl"
        self.port += 2
        return Job([self.torchrun(node, name, ckpt, record, *job_args, nproc=nproc, run_id=name,
                                  root=roots[i] if roots else None, **agent)
                    for i, node in enumerate(self.nodes)], record)


class Launch:
    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.log = proc, log

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Job:
    """A job's agents (one per node) and its run record."""

    def __init__(self, launches: list[Launch], record: Path) -> None:
        self.launches, self.record = launches, record

    def events(self, kind: str) -> list[dict]:
        return [e for e in _record.read(self.record) if e["event"] == kind] if self.record.exists() else []

    def wait(self, timeout: float) -> list[int]:
        """Every agent's exit status (fails, with every log, when one outlives ``timeout``)."""
        deadline = time.monotonic() + timeout
        for launch in self.launches:
            try:
                launch.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a torchrun agent outlived {timeout} s:\n{self.output()}") from None
        return [launch.proc.returncode for launch in self.launches]

    def wait_for(self, kind: str, count: int, where=lambda event: True, timeout: float = 120.0) -> list[dict]:
        """Wait until the record holds ``count`` events of ``kind`` that satisfy ``where`` (the
        agents still running)."""
        deadline = time.monotonic() + timeout
        while len([e for e in self.events(kind) if where(e)]) < count:
            dead = [launch for launch in self.launches if launch.proc.poll() is not None]
            assert not dead, f"an agent exited before {count} {kind} events:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {count} {kind} events in {timeout} s:\n{self.output()}"
            time.sleep(0.1)
        return self.events(kind)

    def output(self) -> str:
        return "\n".join(f"--- {launch.log.name}\n{launch.output()[-6000:]}" for launch in self.launches)


@contextmanager
def two_nodes(workdir: Path, store: str | None = None, node_local: bool = False,
              bucket: Any = None, hold_b: bool = False, env: Any = None, count: int = 2,
              link_mbit: int | None = None) -> Iterator[Cluster]:
    """``count`` namespaces (two by default) with a daemon each, torn down (processes killed by pid)
    on the way out; ``link_mbit``: every node's link shaped to that rate (:func:`shape`).
    ``store``: the durable store of every daemon and jobs; ``bucket`` (a ``_bucket.Bucket``): the
    S3 emulator instead, through a relay per node (node b's a ``HoldingRelay`` with ``hold_b``);
    ``node_local``: each daemon's checkpoint root is its node's own tmpfs on ``workdir/local-<letter>``
    (no directory shared for checkpoints); ``env(cluster, node)``: more variables for a node's
    processes, its daemon's included."""
    sock_dir = Path(tempfile.mkdtemp(prefix="sgmn-", dir="/tmp"))  # ipc:// paths must stay short
    cluster = Cluster(workdir, sock_dir, count, link_mbit)
    try:
        cluster.create()
        for node, letter in zip(cluster.nodes, LETTERS):
            if bucket:
                node.relay = bucket.relay(cluster.nodes[0].name, cluster.nodes[0].addr,
                                          holding=hold_b and node.index == 1)
                node.extra_env.update(bucket.env(node.relay))
            elif store:
                node.extra_env["SPOTGUARD_STORAGE__URL"] = store
            if env is not None:
                node.extra_env.update(env(cluster, node))
            node.start_daemon(cluster.tmpfs(workdir / f"local-{letter}") if node_local else cluster.checkpoint_root)
        yield cluster
    finally:
        cluster.destroy()
        shutil.rmtree(sock_dir, ignore_errors=True)


def peer_ring(port: int, secret: str) -> Any:
    """``env`` for :func:`two_nodes`: the peer tier in a ring, each node's daemon serving partners on
    its address and copying its node's parts to the next node's (a to b, ..., the last to a)."""
    def env(cluster: Cluster, node: Node) -> dict[str, str]:
        partner = cluster.nodes[(node.index + 1) % len(cluster.nodes)]
        return {"SPOTGUARD_PEER__LISTEN": f"{node.addr}:{port}", "SPOTGUARD_PEER__SECRET": secret,
                "SPOTGUARD_PEER__PARTNERS": f"http://{partner.addr}:{port}"}
    return env
