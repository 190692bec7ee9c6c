"""Steps a node lost without notice costs, with and without the peer tier (issue 30).

    python benchmarks/bench_peer_loss.py [--repeats 2] [--width 262144] [--bucket-mbs 50]
                                         [--nodes 2] [--link-mbit 8000] [--scenarios bucket,peer]
                                                                                     (root: ip netns, tc)

``--nodes`` network namespaces (``tests/multinode/_twonodes.py``; three or more on a bridge),
node-local roots (a tmpfs each), the S3 emulator as the bucket with each daemon's uploads capped at
``--bucket-mbs`` MB/s (``storage.bandwidth_mbps``), and the node links unshaped (as fast as the
namespaces allow) or shaped with ``tc`` to ``--link-mbit``. The tests' DDP job (2 ranks a node;
``--width`` hidden units, so a node's part weighs about ``120 * width`` bytes) saves every
``--save-every`` steps. Half a save interval after step ``--kill-at``, the last node is SIGKILLed
whole, its link down first (no notice, no reset). The identical command is relaunched on the
survivors and a fresh node (the lost node's namespace, an empty root, a new daemon).

Per scenario: the step reached at the kill (the newest step any rank recorded), the newest global
step in the bucket then, the step the relaunch resumed from and where each rank took it (the run
record's ``tier``), the steps lost (reached - resumed; everything when the relaunch refuses to start
because no step is common to every rank: no step was global yet), and the relaunch to its first
resumed step.
``bucket``: the peer tier off; ``peer``: a ring (``peer.listen``, ``peer.partners``,
``peer.secret``; node k copies to node k+1). The same job, cadence and kill point in both, run one
after the other.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multinode"))

from _bucket import Bucket  # noqa: E402
from _common import BenchError, markdown_table, write_results  # noqa: E402
from _twonodes import LETTERS, netns_available, peer_ring, two_nodes  # noqa: E402

NPROC, PORT, SECRET = 2, 9475, "the-benchmark-ring-secret-00000"


def reached(job: Any) -> int:
    return max((e["step"] for e in job.events("data") + job.events("progress") + job.events("commit")),
               default=0)


def once(tmp: Path, scenario: str, args: argparse.Namespace, i: int) -> dict[str, Any]:
    def env(cluster: Any, node: Any) -> dict[str, str]:
        return {"SPOTGUARD_STORAGE__BANDWIDTH_MBPS": str(args.bucket_mbs),
                **(peer_ring(PORT, SECRET)(cluster, node) if scenario == "peer" else {})}

    (tmp / f"bucket-{scenario}{i}").mkdir()
    bucket = Bucket(tmp / f"bucket-{scenario}{i}")
    try:
        with two_nodes(tmp / f"{scenario}{i}", bucket=bucket, node_local=True, env=env, count=args.nodes,
                       link_mbit=args.link_mbit or None) as cluster:
            b = cluster.nodes[-1]  # the node lost
            roots = [cluster.workdir / f"local-{LETTERS[n]}" for n in range(args.nodes)]
            job_args = ("--save-every", str(args.save_every), "--step-sleep", str(args.step_sleep),
                        "--width", str(args.width), "--keep", "2", "--peer-timeout", "5")
            job = cluster.launch("lost", "lost", "--steps", "1000000", *job_args, nproc=NPROC, roots=roots)
            mid = args.kill_at + args.save_every // 2  # half an interval after a save: a kill at any instant
            job.wait_for("progress", 1, lambda e: e["step"] >= mid, timeout=600)
            at_kill = reached(job)
            global_step = bucket.durable().latest("multinode-lost")
            b.link_down()
            b.kill_all()
            job.wait(120)
            b.link_up()
            fresh = cluster.tmpfs(cluster.workdir / "local-c")
            b.start_fresh_daemon(fresh)
            relaunched = time.time()
            resumed = cluster.launch("resumed", "lost", "--steps", str(at_kill + 3), *job_args, nproc=NPROC,
                                     roots=[*roots[:-1], fresh])
            if resumed.wait(300) != [0] * args.nodes:
                if "no checkpoint step is held by every rank" not in resumed.output():
                    raise BenchError(resumed.output())
                return {"scenario": scenario, "reached_at_kill": at_kill, "global_at_kill": global_step,
                        "resumed_from": None, "steps_lost": at_kill, "tiers": ["refused: no common step"],
                        "relaunch_to_first_step_s": None}
            starts = resumed.events("start")
            frm = {e["resumed_from"] for e in starts}
            if len(frm) != 1:
                raise BenchError(f"the ranks resumed from {frm}")
            resumed_from = frm.pop() or 0
            first = min((e["t"] for e in resumed.events("data") if e["step"] > resumed_from), default=None)
            return {"scenario": scenario, "reached_at_kill": at_kill, "global_at_kill": global_step,
                    "resumed_from": resumed_from, "steps_lost": at_kill - resumed_from,
                    "tiers": sorted(e.get("tier") or "?" for e in starts),
                    "relaunch_to_first_step_s": None if first is None else round(first - relaunched, 2)}
    finally:
        bucket.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--width", type=int, default=262144)
    parser.add_argument("--bucket-mbs", type=float, default=50.0)
    parser.add_argument("--save-every", type=int, default=6)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--kill-at", type=int, default=60)
    parser.add_argument("--nodes", type=int, default=2, help="nodes (namespaces), 2 ranks each; the last is lost")
    parser.add_argument("--link-mbit", type=int, default=0, help="shape every node's link with tc (0: unshaped)")
    parser.add_argument("--scenarios", default="bucket,peer", help="comma-separated: bucket, peer")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    why = netns_available()
    if why:
        sys.exit(f"bench_peer_loss: {why}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-peer-loss-") as tmp:
        for i in range(args.repeats):
            for scenario in scenarios if i % 2 == 0 else scenarios[::-1]:
                runs.append(once(Path(tmp), scenario, args, i))
                print(runs[-1], flush=True)
    write_results("peer_loss", {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, args.out)
    print(markdown_table(["scenario", "reached at kill", "global step then", "resumed from", "steps lost",
                          "ranks resumed from", "relaunch -> first step s"],
                         [[r["scenario"], r["reached_at_kill"], r["global_at_kill"], r["resumed_from"],
                           r["steps_lost"], ", ".join(r["tiers"]), r["relaunch_to_first_step_s"]] for r in runs]))
    for scenario in scenarios:
        lost = [r["steps_lost"] for r in runs if r["scenario"] == scenario]
        print(f"{scenario}: median steps lost {statistics.median(lost)}")


if __name__ == "__main__":
    main()
