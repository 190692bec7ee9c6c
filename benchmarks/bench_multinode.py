"""Two-node stops: a notice on node b to the last rank's exit on node a, and a node killed outright.

    python benchmarks/bench_multinode.py [--repeats 3] [--quick] [--out PATH]      (root: ip netns)

Two network namespaces joined by a veth pair stand for two nodes, each with its own daemon and its
own torchrun agent (``tests/multinode/_twonodes.py``), running the tests' DDP job
(``tests/multinode/_multinode_job.py``, 2 ranks per node, a step every ~50 ms).

* **notice**: a drill notice with a ``--deadline`` goes to node b's daemon only (a NotifyRequest on
  its socket, timed from just before the send). Measured: until every rank recorded its stop (the
  emergency checkpoint committed), and until the last rank *process* on node a is gone (its
  ``/proc`` entry reaped or a zombie), against the notice's deadline.
* **vanish**: node b's link goes down and every process in its namespace is SIGKILLed (a machine
  powered off: no connection reset reaches node a). Measured: until node a's ranks and its agent are
  gone, against ``peer_timeout + PEER_LOST_GRACE``, and the ranks' exit status.
* **reset**: the same SIGKILL with the link up (the processes die, the kernel resets their
  connections, as when an OOM killer or a crash takes a node's processes).
* **restart**: vanish with ``--max-restarts 1 --rdzv-conf join_timeout=J``: what torchrun's agent
  does after its worker exits 77 (it tries a new rendezvous and waits for the lost node).

``--node-local`` measures node-local roots instead (each node's root a tmpfs of its own, the S3
emulator as the store through a relay per node, ``tests/multinode/_bucket.py``; the job's model
``--width`` wide, so that a checkpoint weighs something), writing ``results/multinode_node_local.json``:

* **notice -> committed**: a notice on node b to every rank of both nodes stopped (their stop
  records), to the step globally committed (``latest`` in the store names it, polled every 20 ms) and
  to the last rank process gone, against the notice's deadline.
* **fresh node**: the identical command relaunched on node a and a fresh node c (an empty root on
  node b's daemon) to the first resumed step (rank 0's first step recorded), and the object bytes
  each node fetched (counted by its relay); side by side, a restore of only node c's ranks' parts
  plus rank 0's against the whole checkpoint (what fetching everything on every node costs), both
  timed from the host straight to the emulator.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multinode"))

import zmq  # noqa: E402
from _common import BenchError, markdown_table, write_results  # noqa: E402
from _bucket import Bucket  # noqa: E402
from _twonodes import Cluster, Job, netns_available, two_nodes  # noqa: E402

from spotguard.protocol import NotifyRequest, decode_reply, encode  # noqa: E402
from spotguard.run import PEER_LOST_GRACE  # noqa: E402

NPROC = 2
JOB_ARGS = ("--steps", "100000", "--save-every", "100", "--step-sleep", "0.05")


def gone(pid: int) -> bool:
    """The process exited (its /proc entry is gone, or it is a zombie not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def exit_times(pids: list[int], timeout: float) -> dict[int, float]:
    """Wall-clock instant each pid exited (polled every 5 ms); missing ones outlived ``timeout``."""
    deadline, found = time.time() + timeout, {}
    while len(found) < len(pids) and time.time() < deadline:
        for pid in pids:
            if pid not in found and gone(pid):
                found[pid] = time.time()
        time.sleep(0.005)
    return found


def training(cluster: Cluster, name: str, *extra: str, **agent: Any):
    """A two-node job, once both nodes' ranks trained a few steps; its ranks' pids by rank."""
    job = cluster.launch(name, name, *JOB_ARGS, *extra, nproc=NPROC, **agent)
    job.wait_for("progress", 1, lambda e: e["step"] >= 10, timeout=300)
    pids = {e["rank"]: e["pid"] for e in job.events("start")}
    return job, pids


def notify(runtime_dir: Path, deadline: float) -> None:
    """A NotifyRequest on the daemon's request socket (what ``spotguard notify`` sends)."""
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{runtime_dir}/requests.sock")
        sock.send(encode(NotifyRequest(deadline_seconds=deadline, detail="bench_multinode")))
        if not sock.poll(10_000) or not decode_reply(sock.recv()).ok:
            raise BenchError("node b's daemon did not take the notice")


def notice_once(cluster: Cluster, i: int, deadline: float) -> dict[str, Any]:
    job, pids = training(cluster, f"notice{i}")
    node_a = [pid for rank, pid in pids.items() if rank < NPROC]
    sent = time.time()
    notify(cluster.nodes[1].runtime_dir, deadline)
    exits = exit_times(node_a, deadline * 2)
    job.wait(120)
    stops = job.events("stop")
    return {"deadline_s": deadline, "ranks": len(pids), "stopped_ranks": len(stops),
            "stop_steps": sorted({e["step"] for e in stops}),
            "notice_to_all_stopped_s": round(max(e["t"] for e in stops) - sent, 3),
            "notice_to_last_exit_node_a_s": round(max(exits.values()) - sent, 3) if len(exits) == NPROC else None,
            "exit_codes": sorted(set(_worker_codes(job)))}


def kill_once(cluster: Cluster, name: str, peer_timeout: float, *, vanish: bool, **agent: Any) -> dict[str, Any]:
    job, pids = training(cluster, name, "--peer-timeout", str(peer_timeout), **agent)
    node_a = [pid for rank, pid in pids.items() if rank < NPROC]
    b = cluster.nodes[1]
    if vanish:
        b.link_down()
    killed = time.time()
    b.kill_all()
    exits = exit_times(node_a, peer_timeout + PEER_LOST_GRACE + 120)
    agent_a = job.launches[0].proc
    limit = time.time() + 900
    while agent_a.poll() is None and time.time() < limit:
        time.sleep(0.01)
    agent_exit = time.time() - killed if agent_a.poll() is not None else None
    return {"vanish": vanish, "peer_timeout_s": peer_timeout, "bound_s": peer_timeout + PEER_LOST_GRACE,
            "kill_to_last_rank_exit_s": round(max(exits.values()) - killed, 3) if len(exits) == NPROC else None,
            "kill_to_agent_exit_s": None if agent_exit is None else round(agent_exit, 3),
            "exit_codes": sorted(set(_worker_codes(job)[:NPROC])), "agent": agent,
            "peer_lost_records": len(job.events("peer_lost"))}


def node_local_once(cluster: Cluster, bucket: Bucket, i: int, deadline: float, width: int) -> dict[str, Any]:
    """A notice on node b to the step globally committed, then the relaunch on node a + a fresh node."""
    name, args = f"local{i}", ("--save-every", "100000", "--width", str(width))
    job_id, roots = f"multinode-local{i}", [cluster.workdir / "local-a", cluster.workdir / "local-b"]
    job, pids = training(cluster, name, *args, roots=roots)
    durable = bucket.durable()
    sent = time.time()
    notify(cluster.nodes[1].runtime_dir, deadline)
    stopped = committed = None
    exits: dict[int, float] = {}
    while (committed is None or len(exits) < len(pids)) and time.time() < sent + deadline * 2:
        exits.update({pid: time.time() for pid in pids.values() if pid not in exits and gone(pid)})
        stops = job.events("stop")
        if stopped is None and len(stops) == len(pids):
            stopped = max(e["t"] for e in stops)
        if committed is None and stopped is not None and durable.latest(job_id) == stops[0]["step"]:
            committed = time.time()
        time.sleep(0.02)
    job.wait(120)
    if committed is None:
        raise BenchError(f"step not globally committed within {deadline * 2:.0f} s:\n{job.output()}")
    step = job.events("stop")[0]["step"]
    fresh = roots[1] / f"fresh{i}"
    fresh.mkdir()
    for node in cluster.nodes:
        node.relay.fetched = 0
    relaunched = time.time()
    resumed = cluster.launch(f"{name}-resumed", name, "--steps", str(step + 3), *args, nproc=NPROC,
                             roots=[roots[0], fresh])
    if resumed.wait(300) != [0, 0]:
        raise BenchError(resumed.output())
    first = min(e["t"] for e in resumed.events("data") if e["step"] > step)
    restores = {}
    for what, ranks in (("own", list(range(NPROC, 2 * NPROC))), ("whole", None)):
        started = time.monotonic()
        restored = durable.restore(job_id, cluster.workdir / f"{what}{i}", ranks=ranks)
        restores[what] = {"s": round(time.monotonic() - started, 3),
                          "bytes": sum(f.stat().st_size for f in restored.rglob("*") if f.is_file())}
    for path in (roots[0] / name, roots[1] / name, fresh):  # the tmpfs roots are small
        shutil.rmtree(path)
    return {"deadline_s": deadline, "width": width, "ranks": len(pids), "stop_step": step,
            "notice_to_all_stopped_s": round(stopped - sent, 3),
            "notice_to_global_commit_s": round(committed - sent, 3),
            "notice_to_last_exit_s": round(max(exits.values()) - sent, 3) if len(exits) == len(pids) else None,
            "relaunch_to_first_step_s": round(first - relaunched, 3),
            "fetched_bytes_node_a": cluster.nodes[0].relay.fetched, "fetched_bytes_node_c": cluster.nodes[1].relay.fetched,
            "restore_own_parts": restores["own"], "restore_whole": restores["whole"]}


def node_local(args: argparse.Namespace, tmp: Path) -> None:
    results: dict[str, Any] = {"nproc_per_node": NPROC, "store": "moto_server via a relay per node", "runs": []}
    bucket = Bucket(tmp)
    try:
        with two_nodes(tmp / "local", bucket=bucket, node_local=True) as cluster:
            for i in range(1 if args.quick else args.repeats):
                results["runs"].append(node_local_once(cluster, bucket, i, args.deadline, args.width))
    finally:
        bucket.close()
    write_results("multinode_node_local", results, args.out)
    runs = results["runs"]
    print(markdown_table(["notice deadline s", "notice -> all ranks stopped s", "notice -> globally committed s",
                          "notice -> last rank exit s"],
                         [[r["deadline_s"], r["notice_to_all_stopped_s"], r["notice_to_global_commit_s"],
                           r["notice_to_last_exit_s"]] for r in runs]))
    print(markdown_table(["relaunch -> first resumed step s", "fetched node a / node c bytes",
                          "restore c's parts + rank 0's: s, bytes", "restore whole checkpoint: s, bytes"],
                         [[r["relaunch_to_first_step_s"], f"{r['fetched_bytes_node_a']} / {r['fetched_bytes_node_c']}",
                           f"{r['restore_own_parts']['s']}, {r['restore_own_parts']['bytes']}",
                           f"{r['restore_whole']['s']}, {r['restore_whole']['bytes']}"] for r in runs]))


def _worker_codes(job: Job) -> list[int]:
    return [int(c) for c in re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", job.output(), re.MULTILINE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=30.0, help="the notice's deadline (s)")
    parser.add_argument("--peer-timeout", type=float, default=10.0)
    parser.add_argument("--join-timeout", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true", help="one notice only (a smoke run)")
    parser.add_argument("--node-local", action="store_true", help="node-local roots and the S3 emulator")
    parser.add_argument("--width", type=int, default=262144, help="--node-local: the model's hidden units")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    why = netns_available()
    if why:
        sys.exit(f"bench_multinode: {why}")
    if args.node_local:
        with tempfile.TemporaryDirectory(prefix="bench-multinode-") as tmp:
            return node_local(args, Path(tmp))
    results: dict[str, Any] = {"nproc_per_node": NPROC, "notice": [], "kill": []}
    with tempfile.TemporaryDirectory(prefix="bench-multinode-") as tmp:
        with two_nodes(Path(tmp) / "notice") as cluster:
            for i in range(1 if args.quick else args.repeats):
                results["notice"].append(notice_once(cluster, i, args.deadline))
        cases = [] if args.quick else [
            *[("vanish", True, {})] * max(1, args.repeats - 1), ("reset", False, {}),
            ("restart", True, {"restarts": 1, "rdzv_conf": f"join_timeout={args.join_timeout:g}"})]
        for i, (name, vanish, agent) in enumerate(cases):
            with two_nodes(Path(tmp) / f"kill{i}") as cluster:
                results["kill"].append({"case": name, **kill_once(cluster, name, args.peer_timeout,
                                                                  vanish=vanish, **agent)})
    write_results("multinode", results, args.out)
    print(markdown_table(["notice deadline s", "ranks stopped", "notice -> all stopped s",
                          "notice -> last exit on node a s", "exit codes"],
                         [[r["deadline_s"], f"{r['stopped_ranks']}/{r['ranks']}", r["notice_to_all_stopped_s"],
                           r["notice_to_last_exit_node_a_s"], r["exit_codes"]] for r in results["notice"]]))
    if results["kill"]:
        print(markdown_table(["case", "bound s", "kill -> last rank exit on node a s", "kill -> agent exit s",
                              "rank exit codes"],
                             [[r["case"], r["bound_s"], r["kill_to_last_rank_exit_s"], r["kill_to_agent_exit_s"],
                               r["exit_codes"]] for r in results["kill"]]))


if __name__ == "__main__":
    main()
