"""Benchmark of the emergency save: notice to committed, against the disk's own speed.

For each state size (the synthetic state of ``bench_checkpoint.py``: 16 MiB float32 tensors plus
256 small ones), every method runs once per round, rounds repeated, so a noisy neighbour hits all
of them alike; medians are reported:

* ``dd if=/dev/zero bs=16M conv=fsync`` of the same bytes: the disk's speed, the target's yardstick;
* ``torch.save`` + fsync of the state;
* spotguard ``save(..., blocking=True)`` in a steady process (its first emergency save done before);
* the same as the first save of a fresh process: a subprocess builds the state and times its one
  emergency save, so nothing (buffers, threads, pinned chunks) was warmed up before;
* the periodic path run to completion, uncapped (snapshot + persist): what an emergency save cost
  before it wrote from live memory.

With ``--device cuda`` the state lives on the GPU and one more yardstick runs: a copy of every tensor
into reused pinned host buffers (the pinned device-to-host bandwidth); a save that must move every
byte off the GPU and onto the disk can at best take max(dd, that copy) when the two overlap.

Every measurement starts after ``os.sync()``. Writes ``results/emergency.json`` and prints the
Markdown table that ``README.md`` carries.

    python benchmarks/bench_emergency.py --sizes 1,4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import markdown_table, write_results
from bench_checkpoint import GiB, add, copy_into, dd, host_buffers, state_bytes, synthetic_state, timed, torch_save
from spotguard.checkpoint import Checkpointer, commit

FIRST_SAVE = """
import os, sys, time, torch
from spotguard.checkpoint import Checkpointer
size, root, device = int(sys.argv[1]), sys.argv[2], sys.argv[3]
big = {f"layer{i}.weight": torch.full(((16 << 20) // 4,), float(i), device=device) for i in range(size // (16 << 20))}
small = {f"layer{i}.bias": torch.randn(1024, device=device) for i in range(256)}
state = {"model": {**big, **small}, "extras": {"step": 1}}
ck = Checkpointer(root, keep=1)
if device == "cuda":
    torch.cuda.synchronize()
os.sync()
time.sleep(0.3)
start = time.perf_counter()
ck.save(1, state, blocking=True)
print(time.perf_counter() - start)
"""


def first_save(nbytes: int, root: Path, device: str) -> float:
    """Notice-to-committed seconds of the first emergency save of a fresh process."""
    done = subprocess.run([sys.executable, "-c", FIRST_SAVE, str(nbytes), str(root), device], check=True,
                          capture_output=True, text=True)
    shutil.rmtree(root)
    return float(done.stdout.split()[-1])


def emergency(ck: Checkpointer, step: int, state: dict) -> float:
    took = timed(lambda: ck.save(step, state, blocking=True))
    # An emergency save leaves the old checkpoint for the next periodic save to delete (a process
    # exits after it); here the next round's save would delete it first, on the clock.
    commit.apply_retention(ck.root, ck.keep)
    return took


def periodic_to_commit(ck: Checkpointer, step: int, state: dict) -> float:
    def save() -> None:
        ck.save(step, state)
        ck.wait()
    return timed(save)


def bench_size(gib: float, workdir: Path, repeats: int, device: str) -> dict:
    state = synthetic_state(int(gib * GiB), device)
    nbytes = state_bytes(state)
    pinned = host_buffers(state) if device == "cuda" else None
    ck = Checkpointer(workdir / "emergency", keep=1)
    old = Checkpointer(workdir / "periodic", keep=1, background_nice=None, background_cpu_share=None)
    ck.save(0, state, blocking=True)  # the steady rows: not the first save of this process
    old.save(0, state)
    old.wait()
    samples: dict[str, list[float]] = {}
    for r in range(1, repeats + 1):
        add(samples, "dd_s", timed(lambda: dd(nbytes, workdir / "dd.bin"), workdir / "dd.bin"))
        if pinned is not None:
            add(samples, "d2h_pinned_s", timed(lambda: copy_into(state, pinned)))
        add(samples, "emergency_s", emergency(ck, r, state))
        add(samples, "torch_save_s", timed(lambda: torch_save(state, workdir / "t.pt"), workdir / "t.pt"))
        add(samples, "first_emergency_s", first_save(nbytes, workdir / f"first-{r}", device))
        add(samples, "periodic_path_s", periodic_to_commit(old, r, state))
    bandwidth = ck.emergency.bandwidth
    for c in (ck, old):
        c.close()
        shutil.rmtree(c.root)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {"size_bytes": nbytes, **medians, "emergency_bandwidth_mb_s": bandwidth / 1e6, "samples": samples}


def table(results: dict) -> str:
    header = ["state", "dd conv=fsync", "torch.save+fsync", "spotguard emergency, first save of a process",
              "spotguard emergency, steady", "first / dd", "steady / dd", "periodic path to commit (before)"]
    if results.get("device", "cpu") != "cpu":
        header += ["pinned D2H copy", "steady / max(dd, D2H)"]
    return markdown_table(header, [_row(row) for row in results["sizes"]])


def _row(row: dict) -> list[str]:
    dd_s, first, steady = row["dd_s"], row["first_emergency_s"], row["emergency_s"]
    cells = [f"{row['size_bytes'] / GiB:.2f} GiB", f"{dd_s:.2f} s", f"{row['torch_save_s']:.2f} s",
             f"{first:.2f} s", f"{steady:.2f} s", f"{first / dd_s:.2f}x", f"{steady / dd_s:.2f}x",
             f"{row['periodic_path_s']:.2f} s"]
    if "d2h_pinned_s" in row:
        cells += [f"{row['d2h_pinned_s']:.2f} s", f"{steady / max(dd_s, row['d2h_pinned_s']):.2f}x"]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4", help="state sizes in GiB, comma separated (0.25 = 256 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new one under /tmp)")
    parser.add_argument("--out", default=None, help="results file (default: results/emergency.json)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the state lives")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="spotguard-bench-", dir=args.dir))
    started = time.perf_counter()
    try:
        sizes = [float(s) for s in args.sizes.split(",")]
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        results = {"repeats": args.repeats, "disk_dir": str(workdir), "device": device,
                   "sizes": [bench_size(g, workdir, args.repeats, args.device) for g in sizes]}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - started
    write_results("emergency", results, Path(args.out) if args.out else None)
    print(table(results))
    print(json.dumps({"wall_s": round(results["wall_s"], 1)}))


if __name__ == "__main__":
    main()
