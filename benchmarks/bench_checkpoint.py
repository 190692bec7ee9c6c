"""Benchmark of spotguard's checkpoint engine against the baselines the issue names.

For each state size (synthetic: 16 MiB float32 tensors plus small ones, like a model + optimizer):

* stall: what the training loop waits for. spotguard ``save()`` (reused staging buffers) vs a plain
  memory copy into fresh buffers (``clone``), synchronous ``torch.save`` + fsync, and
  ``torch.distributed.checkpoint.async_save`` (single-process gloo group, returns after staging).
* first-save stall: a Checkpointer whose ``load_latest`` prepared the staging buffers in the
  background (the time that took is reported too) vs the steady stall; and, for reference, the first
  save of a Checkpointer that was given no time to prepare.
* persist: bytes / (write + sha256 + fsync + rename) of the background part vs the ceiling
  ``max(dd conv=fsync, torch.save + fsync)`` of the same size. Deleting is timed for none of them:
  on this disk (ext4, online ``discard``) an unlink takes 0.75 s per GiB, and spotguard deletes old
  checkpoints after the commit is reported, off the save's clock (``Checkpointer._apply_retention``).
* step-time inflation of a CPU training loop while a background persist runs (256 MiB state,
  short interleaved rounds), default throttling vs none.
* notice-to-committed emergency save: idle, and while a periodic save is still in flight (1 GB).

``--device cuda`` puts the state on the GPU. The baselines then move the same bytes off it: "clone"
is ``Tensor.cpu()`` into fresh pageable memory, "copy_" a copy into reused pinned buffers (the
pinned device-to-host bandwidth, the floor of a stall that must get every byte off the GPU);
``torch.save`` and DCP take the CUDA tensors as they are. The inflation rows run only for ``cpu``.

Medians over ``--repeats``; everything in one run, on one disk. Writes ``results/checkpoint.json``
and prints the Markdown table that ``README.md`` carries.

    python benchmarks/bench_checkpoint.py --sizes 1,4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from _common import markdown_table, write_results
from spotguard.checkpoint import Checkpointer

GiB = 1 << 30
MAX_STEPS_DURING = 200
INFLATION_STATE = 256 << 20
INFLATION_SETTINGS = [(19, 0.25), (19, 0.5), (None, None)]
"""(background_nice, background_cpu_share) pairs; the first is the default (the share an adaptive
budget starts from: the loop reports its steps, see ``observed``)."""
"""Training steps measured per background save at most (a niced save under a saturated CPU is slow)."""
CHUNK = 16 << 20


def synthetic_state(size: int, device: str = "cpu") -> dict:
    big = {f"layer{i}.weight": torch.randn(CHUNK // 4, device=device) for i in range(size // CHUNK)}
    small = {f"layer{i}.bias": torch.randn(1024, device=device) for i in range(256)}
    return {"model": {**big, **small}, "extras": {"step": 1, "lr": 0.1}}


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def settle() -> None:
    """Flush other dirty data (and discards of deleted files) so each measurement starts level."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    os.sync()
    time.sleep(0.3)


def timed(fn, written: Path | None = None) -> float:
    """Seconds ``fn`` took, from a settled disk; ``written`` (a file it wrote) is deleted after."""
    settle()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    took = time.perf_counter() - start
    if written is not None:
        written.unlink()
    return took


def clone_all(state: dict) -> None:
    copies = {k: t.cpu() if t.is_cuda else t.clone() for k, t in state["model"].items()}
    del copies


def host_buffers(state: dict) -> dict:
    """Reused destination buffers of ``copy_into``: pinned host memory for CUDA tensors."""
    return {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for k, t in state["model"].items()}


def copy_into(state: dict, buffers: dict) -> None:
    for k, t in state["model"].items():
        buffers[k].copy_(t, non_blocking=t.is_cuda)


def torch_save(state: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def dd(nbytes: int, path: Path) -> None:
    cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={CHUNK}", f"count={nbytes // CHUNK}", "conv=fsync"]
    subprocess.run(cmd, check=True, capture_output=True)


def dcp_save(state: dict, target: Path) -> tuple[float, float]:
    """(stall, total) of DCP async_save; total includes its own write + fsync."""
    settle()
    start = time.perf_counter()
    future = dcp.async_save({"model": state["model"]}, checkpoint_id=str(target))
    stall = time.perf_counter() - start
    (future.upload_completion if hasattr(future, "upload_completion") else future).result()
    total = time.perf_counter() - start
    shutil.rmtree(target)
    return stall, total


def spotguard_save(ck: Checkpointer, step: int, state: dict) -> tuple[float, float]:
    settle()
    ck.save(step, state)
    ck.wait()
    return ck.stats.blocking_seconds, ck.stats.persist_seconds


def bench_interleaved(state: dict, workdir: Path, repeats: int) -> dict:
    """Every method once per round, rounds repeated: a noisy neighbour hits all of them alike."""
    nbytes = state_bytes(state)
    buffers = host_buffers(state)
    # Throughput is measured at normal priority, like the baselines; the default nice shows in inflation.
    ck = Checkpointer(workdir / "spotguard", keep=1, background_nice=None, background_cpu_share=None)
    samples: dict[str, list[float]] = first_saves(ck, state, workdir / "unprepared")
    for r in range(1, repeats + 1):
        add(samples, "clone_s", timed(lambda: clone_all(state)))
        add(samples, "copy_into_s", timed(lambda: copy_into(state, buffers)))
        add(samples, "stall_s", "persist_s", spotguard_save(ck, r, state))
        add(samples, "torch_save_s", timed(lambda: torch_save(state, workdir / "t.pt"), workdir / "t.pt"))
        add(samples, "dd_s", timed(lambda: dd(nbytes, workdir / "dd.bin"), workdir / "dd.bin"))
        add(samples, "dcp_stall_s", "dcp_total_s", dcp_save(state, workdir / f"dcp-{r}"))
    ck.close()
    shutil.rmtree(workdir / "spotguard")
    return {"size_bytes": nbytes, **{k: statistics.median(v) for k, v in samples.items()}, "samples": samples}


def first_saves(ck: Checkpointer, state: dict, other: Path) -> dict[str, list[float]]:
    """The first save of ``ck`` after ``load_latest`` prepared its buffers (on fresh memory), then
    the first save of a Checkpointer with no time to prepare (its memory may be recycled from the
    first: if anything, its stall is understated)."""
    start = time.perf_counter()
    ck.load_latest(state)  # an empty root: a fresh start, which prepares the staging buffers
    ck._stager.wait_prepared()  # the training steps before the first save would take this long
    prepared = time.perf_counter() - start
    settle()
    start = time.perf_counter()
    ck.save(0, state)
    first = time.perf_counter() - start
    ck.wait()
    cold = Checkpointer(other, keep=1, background_nice=None, background_cpu_share=None)
    settle()
    start = time.perf_counter()
    cold.save(0, state)
    unprepared = time.perf_counter() - start
    cold.close()
    shutil.rmtree(other)
    return {"prepare_s": [prepared], "first_stall_s": [first], "first_stall_unprepared_s": [unprepared]}


def add(samples: dict, *names_and_value) -> None:
    *names, value = names_and_value
    for name, v in zip(names, value if len(names) > 1 else [value]):
        samples.setdefault(name, []).append(v)


def make_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - start
    return step


def bench_inflation(workdir: Path, nice: int | None, share: float | None, rounds: int = 6) -> dict:
    """Median step time while a background persist runs vs. steps right before it. Many short
    rounds (256 MiB state) interleave the two, so a noisy neighbour weighs on both alike."""
    state, step = synthetic_state(INFLATION_STATE), make_loop()
    ck = Checkpointer(workdir / "infl", keep=1, background_nice=nice, background_cpu_share=share)
    ck.save(0, state)  # allocate staging buffers outside the measurement
    ck.wait()
    base, during, windows = [], [], []
    for r in range(1, rounds + 1):
        settle()
        base += [observed(ck, step()) for _ in range(10)]
        start = time.perf_counter()
        ck.save(r, state)
        while ck.in_flight and len(during) < r * MAX_STEPS_DURING:
            during.append(observed(ck, step()))
        windows.append(time.perf_counter() - start)
        ck.wait()
    ck.close()
    shutil.rmtree(workdir / "infl")
    b, d = statistics.median(base), statistics.median(during)
    return {"nice": nice, "cpu_share": share, "state_bytes": INFLATION_STATE, "base_step_s": b, "during_step_s": d,
            "steps_during": len(during), "inflation": d / b - 1, "persist_window_s": windows,
            "persist_finished_in_window": len(during) < rounds * MAX_STEPS_DURING}


def observed(ck: Checkpointer, seconds: float) -> float:
    """Report a step's time as Run does: the adaptive CPU budget of a default save steers by it."""
    ck.observe_step(seconds)
    return seconds


def bench_emergency(state: dict, workdir: Path) -> dict:
    ck = Checkpointer(workdir / "emergency", keep=1)
    start = time.perf_counter()
    ck.save(0, state, blocking=True)  # idle node: first save of the process (buffers allocated)
    idle_first = time.perf_counter() - start
    start = time.perf_counter()
    ck.save(1, state, blocking=True)
    idle = time.perf_counter() - start
    ck.save(2, state)  # a periodic save has just started when the notice arrives
    start = time.perf_counter()
    ck.save(3, state, blocking=True)
    in_flight = time.perf_counter() - start
    ck.close()
    shutil.rmtree(workdir / "emergency")
    return {"idle_first_s": idle_first, "idle_s": idle, "with_save_in_flight_s": in_flight}


def bench_size(gib: float, workdir: Path, repeats: int, extended: bool, device: str) -> dict:
    state = synthetic_state(int(gib * GiB), device)
    row = bench_interleaved(state, workdir, repeats)
    if extended:
        if device == "cpu":
            row["inflation"] = [bench_inflation(workdir, n, c) for n, c in INFLATION_SETTINGS]
        row["emergency"] = bench_emergency(state, workdir)
    return row


def table(results: dict) -> str:
    header = ["state", "clone (fresh buffers)", "copy_ (reused buffers)", "spotguard stall", "stall / clone",
              "stall / copy_", "torch.save+fsync", "DCP async_save stall", "spotguard persist", "dd conv=fsync",
              "persist / dd", "persist / torch.save"]
    return markdown_table(header, [_row(row) for row in results["sizes"]])


def _row(row: dict) -> list[str]:
    mb, stall, persist = row["size_bytes"] / 1e6, row["stall_s"], row["persist_s"]
    return [f"{row['size_bytes'] / GiB:.2f} GiB", f"{row['clone_s']:.3f} s", f"{row['copy_into_s']:.3f} s",
            f"{stall:.3f} s", f"{stall / row['clone_s']:.2f}x", f"{stall / row['copy_into_s']:.2f}x",
            f"{row['torch_save_s']:.2f} s", f"{row['dcp_stall_s']:.3f} s", f"{mb / persist:.0f} MB/s",
            f"{mb / row['dd_s']:.0f} MB/s", f"{row['dd_s'] / persist:.0%}", f"{row['torch_save_s'] / persist:.2f}x"]


def periodic_table(results: dict) -> str:
    """The periodic path against its targets: first stall <= 2x steady, persist >= 90 % of the ceiling."""
    header = ["state", "buffers prepared in (background)", "first stall", "first stall, unprepared",
              "steady stall", "first / steady", "spotguard persist", "dd conv=fsync", "torch.save+fsync",
              "persist / ceiling"]
    rows = []
    for row in results["sizes"]:
        mb = row["size_bytes"] / 1e6
        ceiling = min(row["dd_s"], row["torch_save_s"])
        rows.append([f"{row['size_bytes'] / GiB:.2f} GiB", f"{row['prepare_s']:.2f} s", f"{row['first_stall_s']:.3f} s",
                     f"{row['first_stall_unprepared_s']:.3f} s", f"{row['stall_s']:.3f} s",
                     f"{row['first_stall_s'] / row['stall_s']:.2f}x", f"{mb / row['persist_s']:.0f} MB/s",
                     f"{mb / row['dd_s']:.0f} MB/s", f"{mb / row['torch_save_s']:.0f} MB/s",
                     f"{ceiling / row['persist_s']:.0%}"])
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4", help="state sizes in GiB, comma separated (0.0625 = 64 MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new one under /tmp)")
    parser.add_argument("--out", default=None, help="results file (default: results/checkpoint.json)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the state lives")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="spotguard-bench-", dir=args.dir))
    dist.init_process_group("gloo", init_method=f"file://{workdir}/pg", rank=0, world_size=1)
    try:
        sizes = [float(s) for s in args.sizes.split(",")]
        results = {"torch": torch.__version__, "disk_dir": str(workdir), "repeats": args.repeats,
                   "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "sizes": [bench_size(g, workdir, args.repeats, g == sizes[0], args.device) for g in sizes]}
    finally:
        dist.destroy_process_group()
        shutil.rmtree(workdir, ignore_errors=True)
    write_results("checkpoint", results, Path(args.out) if args.out else None)
    print(table(results))
    print(periodic_table(results))
    print(json.dumps({k: v for row in results["sizes"] for k, v in row.items() if k in ("inflation", "emergency")},
                     indent=1))


if __name__ == "__main__":
    main()
