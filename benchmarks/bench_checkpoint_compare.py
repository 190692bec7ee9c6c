"""Checkpoint paths side by side, as a user would pick them: save, durable, step inflation, restore.

Variants, each in a process of its own per round, rounds interleaved (a noisy neighbour hits all
alike), medians over ``--rounds``: ``torch.save`` (+ fsync), DCP ``save``, DCP ``async_save``,
spotguard with its defaults (nice 19, adaptive CPU budget fed by the loop's step times, as ``Run``
does), spotguard uncapped, and ``dd`` (write ``conv=fsync``, cold read) as the disk's yardstick; beside ``dd``'s one buffered
stream, the same file read cold by 4 threads ``O_DIRECT`` (``parallel_read``): the disk's speed for
reads like a restore's. After a spotguard restore, its own checkpoint's files are read cold the same
way into reused buffers, with no check and no fresh memory (``files_read_s``): the disk's time for those
files, which a restore cannot beat. Where ``/sys`` shows the disk, each read also records its mean
request size (``*_request_kib``): on a virtio disk whose cost is per request, the size sets the speed.
``spotguard_4k_pages`` (run only when named in ``--variants``) is the default with
``SPOTGUARD_HUGE_PAGES=0``; spotguard's rows record the last huge page probe (``probe_*_ms``).

The state is a real model plus AdamW (state created by one step); a small separate training loop
(4 x Linear(1024)) runs before and while an asynchronous save persists, so inflation is
``median step during / median of the steps before - 1``; ``no_save`` measures it with nothing
persisting (as many steps as a persist typically spans), the method's own drift on this machine. "stall" is the save call alone; "durable"
is the save call to committed (fsync + rename for spotguard; the future for DCP async). spotguard's
staging buffers are prepared in the background after ``load_latest``, before the save (as the steps
before a job's first save give them time to): that time is its own column, not the stall. The restore loads into the live model and
optimizer from a cold cache (``posix_fadvise(DONTNEED)`` on every file after ``sync``); its peak RSS
is sampled every 2 ms from ``/proc/self/statm`` and counts spotguard's staging buffers, prepared in
the background after the restore, until they are ready. ``--small`` uses 20,000 tensors of 1 KiB
plus AdamW instead.

``--device cuda`` puts the state and the training loop on the GPU (each step timed to its
``synchronize``; a wider loop, :data:`GPU_LOOP`), as on a GPU node whose loop leaves the cores idle; ``dd``'s row then also times a
copy of the whole state from pinned host buffers into the live CUDA tensors (``h2d_pinned_s``): a
restore's floor is the disk's read plus that copy. A variant that fails is reported and left out of
the later rounds; the results file is written after every round.

    python benchmarks/bench_checkpoint_compare.py --gib 1 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VARIANTS = ["torch_save", "dcp", "dcp_async", "spotguard", "spotguard_uncapped", "no_save", "dd"]
VARIANT_ENV = {"spotguard_4k_pages": {"SPOTGUARD_HUGE_PAGES": "0"}}
"""Variants that are another's code under other settings (not run unless named in --variants)."""
CONTROL_STEPS = 30
"""Steps ``no_save`` measures after the baseline's: the method's own drift, with nothing persisting."""
PAGE = os.sysconf("SC_PAGE_SIZE")
GPU_LOOP = (4096, 4096)
"""The loop's width and batch with ``--device cuda``: steps of tens of ms on an H200 (fp32), as a GPU
job's are, with the CPU mostly idle. The CPU loop's size gave 1 ms steps of kernel launches there,
whose time varied by 40 % between processes: no measure of what a persist costs a real step."""
MAX_STEPS_DURING = 2000
"""Steps measured at most while a save persists; the save's end is then waited for without steps."""
BATCH, BASE_STEPS, WARM_STEPS = 256, 20, 30
"""The training loop's batch, its steps before a save (the baseline), and the steps before those,
reported to the budget but not measured (the smoke test makes them small). On this VM the first
second of steps after the staging buffers were touched ran 55-65 ms instead of 37-40 ms in about
half the rounds (never in ``no_save``, which touches none), which made the baseline, not the
persist, set the inflation."""


DEVICE = "cpu"
"""Where the state and the loop live (``--device``)."""


def sync() -> None:
    """Wait for the GPU's queued work (nothing on CPU), so a timing covers it."""
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()


def build(gib: float, small: bool):
    import torch

    torch.manual_seed(0)
    if small:
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(256)) for _ in range(20_000)])
    else:  # params are a third of model + AdamW's two moments
        n = max(1, round(gib * (1 << 30) / 3 / (4 << 20)))
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False, device=DEVICE) for _ in range(n)])
    model = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    sync()
    return model, opt


def loop():
    import torch

    width, batch = GPU_LOOP if DEVICE == "cuda" else (1024, BATCH)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(DEVICE)
    opt, x = torch.optim.SGD(net.parameters(), lr=1e-3), torch.randn(batch, width, device=DEVICE)

    def step() -> float:
        began = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        sync()
        return time.perf_counter() - began
    return step


def evict(path: Path) -> None:
    os.sync()
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


class PeakRss:
    """Peak RSS above the level at entry, sampled every 2 ms."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.extra = self.peak - self.base


def fill(fd: int, view: memoryview, start: int, end: int, path: Path) -> None:
    """Read the file's bytes ``start:end`` into ``view[start:end]``; a short file is an error."""
    while start < end:
        n = os.preadv(fd, [view[start:end]], start)
        if not n:
            raise EOFError(path)
        start += n


def parallel_read(path: Path, threads: int = 4, span: int = 16 << 20) -> float:
    """Seconds to read ``path`` cold into one page-aligned buffer, ``threads`` spans of ``span``
    bytes in flight, ``O_DIRECT`` where the file system takes it: the disk's own speed for reads
    like a restore's, a yardstick beside ``dd``'s one buffered stream."""
    size = path.stat().st_size
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)

    def read(start: int) -> None:
        fill(fd, view, start, min(start + span, size), path)
    began = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(0, size, span)))
        return time.perf_counter() - began
    finally:
        os.close(fd)
        view.release()
        buf.close()


def own_files_read(root: Path, threads: int = 4) -> float:
    """Seconds to read every file under ``root`` cold, ``threads`` files at a time, as a restore
    reads them (``O_DIRECT`` where the file system takes it, a page-aligned buffer per thread,
    reused): the disk's own time for this checkpoint's files, without checks or fresh memory."""
    files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    span = max((p.stat().st_size for p in files), default=0) + PAGE
    local = threading.local()

    def read(path: Path) -> None:
        if not hasattr(local, "view"):
            local.view = memoryview(mmap.mmap(-1, span))  # touched once per thread, before the clock
        size, view = path.stat().st_size, local.view
        try:  # O_DIRECT for whole pages, as FileReader; tmpfs before Linux 6.6 refuses it
            fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if size % PAGE == 0 else 0))
        except OSError:
            fd = os.open(path, os.O_RDONLY)
        try:
            fill(fd, view, 0, size, path)
        finally:
            os.close(fd)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: read(files[0]), range(threads)))  # each thread's buffer, warm
        evict(root)
        began = time.perf_counter()
        list(pool.map(read, files))
        return time.perf_counter() - began


class DiskRequests:
    """Reads and bytes the block device under ``path`` completed meanwhile (``/sys/dev/block``);
    ``kib`` is the mean request size, None where ``/sys`` does not show the device (tmpfs, overlay)."""

    def __init__(self, path: Path) -> None:
        st = os.stat(path)
        self.stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
        self.kib: float | None = None

    def _reads(self) -> tuple[int, int] | None:
        try:
            fields = self.stat.read_text().split()
            return int(fields[0]), int(fields[2])  # reads completed, sectors read
        except (OSError, ValueError, IndexError):
            return None

    def __enter__(self) -> DiskRequests:
        self.before = self._reads()
        return self

    def __exit__(self, *exc: object) -> None:
        after = self._reads()
        if self.before and after and after[0] > self.before[0]:
            self.kib = (after[1] - self.before[1]) * 512 / (after[0] - self.before[0]) / 1024


def steps_measured(out: dict, base: list[float], during: list[float]) -> None:
    """The step medians before and during the save, and the inflation they make."""
    out["step_s"], out["step_during_s"] = statistics.median(base), statistics.median(during)
    out["inflation"], out["steps_during"] = out["step_during_s"] / out["step_s"] - 1, len(during)


def state_tensors(model, opt) -> list:
    import torch

    sd = {"m": model.state_dict(), "o": opt.state_dict()["state"]}
    return [t for t in _tensors(sd) if isinstance(t, torch.Tensor)]


def state_bytes(model, opt) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(model, opt))


def h2d_pinned(model, opt) -> float:
    """Seconds to copy the whole state from pinned host buffers into its live CUDA tensors."""
    import torch

    tensors = [t for t in state_tensors(model, opt) if t.is_cuda]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for _ in range(2):  # the first pass warms the copy engines; the second is timed
        sync()
        began = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(tensors, pinned):
                dst.copy_(src, non_blocking=True)
        sync()
        seconds = time.perf_counter() - began
    return seconds


def _tensors(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    else:
        yield obj


def run_variant(variant: str, gib: float, small: bool, work: Path, loop_threads: int | None = None) -> dict:
    """One round of one variant, in this (fresh) process; ``loop_threads``: the loop's torch threads
    (None: torch's default, every core)."""
    import torch

    if loop_threads:
        torch.set_num_threads(loop_threads)

    model, opt = build(gib, small)
    nbytes = state_bytes(model, opt)
    out = {"variant": variant, "bytes": nbytes}
    step = loop()
    path = work / variant
    setup = SETUP_FNS.get(variant)
    observe = setup(path, model, opt, out) if setup else (lambda seconds: None)  # Run's observe_step
    for _ in range(WARM_STEPS):
        observe(step())
    base = []
    for _ in range(BASE_STEPS):
        base.append(step())
        observe(base[-1])
    if variant == "no_save":  # the control: the same steps measured with nothing persisting
        steps_measured(out, base, [step() for _ in range(CONTROL_STEPS)])
        return out
    if variant == "dd":
        blocks = max(1, nbytes >> 24)
        began = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={blocks}", "conv=fsync"],
                       check=True, capture_output=True)
        out["durable_s"] = out["stall_s"] = time.perf_counter() - began
        evict(path)
        with DiskRequests(path) as requests:
            began = time.perf_counter()
            subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
            out["restore_s"] = time.perf_counter() - began
        if requests.kib:
            out["restore_request_kib"] = requests.kib
        evict(path)
        out["parallel_read_s"] = parallel_read(path)
        if DEVICE == "cuda":
            out["h2d_pinned_s"] = h2d_pinned(model, opt)
        return out
    save, restore = VARIANT_FNS[variant]
    during: list[float] = []
    began = time.perf_counter()
    done = save(path, model, opt, base, out)
    began = out.pop("save_began", began)  # spotguard's set-up before its save is not the save's stall
    out["stall_s"] = time.perf_counter() - began
    while not done() and len(during) < MAX_STEPS_DURING:
        during.append(step())
        observe(during[-1])
    while not done():  # steps of a few ms (a GPU loop) run out before a large persist ends
        time.sleep(0.001)
    out["durable_s"] = out.pop("durable_at", time.perf_counter()) - began
    if during:
        steps_measured(out, base, during)
    if "_ck" in out and out["_ck"]._budget is not None:
        out["share_end"] = float(out["_ck"]._budget.share)
    if "_ck" in out:  # its staging copy goes before the restore is measured
        out.pop("_ck").close()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    evict(path)
    with PeakRss() as rss, DiskRequests(work) as requests:
        began = time.perf_counter()
        restore(path, model, opt, out)
        sync()
        out["restore_s"] = time.perf_counter() - began
        out.pop("wait_prepared", lambda: None)()
    out["restore_peak_rss_extra"] = rss.extra / nbytes
    if requests.kib:
        out["restore_request_kib"] = requests.kib
    if variant.startswith("spotguard"):
        from spotguard.checkpoint import _hugepages

        probe = _hugepages.state()["last_probe"]  # the last probe's CPU s: 2 MiB as 4 KiB pages, as one
        if probe is not None:
            out["probe_4k_pages_ms"], out["probe_huge_page_ms"] = probe[0] * 1e3, probe[1] * 1e3
        with DiskRequests(work) as requests:
            out["files_read_s"] = own_files_read(path)
        if requests.kib:
            out["files_read_request_kib"] = requests.kib
    assert all(bool((p != 0).any()) for p in list(model.parameters())[:3]), "restore left zeros"
    return out


def _sync_done() -> bool:
    return True


def torch_save(path, model, opt, base, out):
    import torch

    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    return _sync_done


def torch_load(path, model, opt, out):
    import torch

    sd = torch.load(path)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["opt"])


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    return {"model": m, "opt": o}


def dcp_save(path, model, opt, base, out):
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(model, opt), checkpoint_id=str(path))
    return _sync_done


def dcp_async(path, model, opt, base, out):
    import torch.distributed.checkpoint as dcp

    future = dcp.async_save(_dcp_state(model, opt), checkpoint_id=str(path))
    future = getattr(future, "upload_completion", future)
    future.add_done_callback(lambda _: out.setdefault("durable_at", time.perf_counter()))
    return future.done


def dcp_load(path, model, opt, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, opt)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["opt"])


def _spotguard_setup(uncapped: bool):
    def setup(path, model, opt, out):
        """The Checkpointer of a fresh start, before the loop's first steps, as a job makes it."""
        from spotguard.checkpoint import Checkpointer

        kwargs = {"background_nice": None, "background_cpu_share": None} if uncapped else {}
        ck = Checkpointer(path, keep=1, **kwargs, on_commit=lambda _: out.setdefault("durable_at", time.perf_counter()))
        began = time.perf_counter()
        ck.load_latest({"model": model, "optimizer": opt})  # a fresh start: prepares the staging buffers
        ck._stager.wait_prepared()  # as the steps before a job's first save would give it time to
        out["prepare_s"] = time.perf_counter() - began  # in the background, under the budget's share
        out["_ck"] = ck
        return ck.observe_step  # what Run reports at each step, before and while the save persists
    return setup


def spotguard_save(path, model, opt, base, out):
    ck = out["_ck"]
    out["save_began"] = time.perf_counter()
    ck.save(1, {"model": model, "optimizer": opt})
    if ck._budget is not None:  # the share (cores) the budget started this persist with
        out["share_start"] = float(ck._budget.share)
    return lambda: not ck.in_flight


def spotguard_load(path, model, opt, out):
    from spotguard.checkpoint import Checkpointer

    ck = Checkpointer(path, keep=1)
    ck.load_latest({"model": model, "optimizer": opt})
    out["wait_prepared"] = ck._stager.wait_prepared  # counted in the peak RSS, not in the time


VARIANT_FNS = {"torch_save": (torch_save, torch_load), "dcp": (dcp_save, dcp_load),
               "dcp_async": (dcp_async, dcp_load), "spotguard": (spotguard_save, spotguard_load),
               "spotguard_uncapped": (spotguard_save, spotguard_load),
               "spotguard_4k_pages": (spotguard_save, spotguard_load)}
SETUP_FNS = {"spotguard": _spotguard_setup(False), "spotguard_uncapped": _spotguard_setup(True),
             "spotguard_4k_pages": _spotguard_setup(False)}


def child(args) -> None:
    import torch.distributed as dist

    work = Path(tempfile.mkdtemp(prefix="ckcmp-", dir=args.dir))
    global DEVICE
    DEVICE = args.device
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=0, world_size=1)
    try:
        result = run_variant(args.variant, args.gib, args.small, work, args.loop_threads)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("_") and k != "wait_prepared"}))


def _ratio(value: float, base: float | None) -> str:
    """``value / base`` as a table cell; "-" where the run had no baseline variant."""
    return f"{value / base:.2f}x" if base else "-"


def table(rows: dict[str, dict]) -> str:
    ref = rows.get("torch_save", {})
    dd = rows.get("dd", {})
    par = dd.get("parallel_read_s")
    lines = ["| variant | stall | durable | durable / dd write | step inflation while persisting | restore (cold) "
             "| restore / torch.load | restore / dd read | restore / parallel read "
             "| restore / its files read | restore peak RSS above the state | buffers prepared in |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "stall_s" not in r:  # the control: only its steps
            lines.append(f"| {name} (control) | - | - | - | {r['inflation']:+.1%} | - | - | - | - | - | - | - |")
            continue
        infl = f"{r['inflation']:+.1%}" if "inflation" in r else "-"
        rss = f"{r['restore_peak_rss_extra']:.2f}x" if "restore_peak_rss_extra" in r else "-"
        prep = f"{r['prepare_s']:.2f} s" if "prepare_s" in r else "-"
        vs_par = f"{r['restore_s'] / par:.2f}x" if par else "-"
        vs_files = f"{r['restore_s'] / r['files_read_s']:.2f}x" if "files_read_s" in r else "-"
        lines.append(f"| {name} | {r['stall_s']:.3f} s | {r['durable_s']:.2f} s | "
                     f"{_ratio(r['durable_s'], dd.get('durable_s'))} | {infl} | {r['restore_s']:.2f} s | "
                     f"{_ratio(r['restore_s'], ref.get('restore_s'))} | {_ratio(r['restore_s'], dd.get('restore_s'))} | "
                     f"{vs_par} | {vs_files} | {rss} | {prep} |")
    sizes = [f"{n} {r['restore_request_kib']:.0f}" + (f" (its files read: {r['files_read_request_kib']:.0f})"
                                                      if "files_read_request_kib" in r else "")
             for n, r in rows.items() if "restore_request_kib" in r]
    if sizes:
        lines.append("\nmean read request (KiB) of the restore: " + "; ".join(sizes))
    if dd.get("h2d_pinned_s") is not None:
        floor = dd["h2d_pinned_s"] + (par or dd["restore_s"])
        lines.append(f"\npinned H2D of the whole state: {dd['h2d_pinned_s']:.3f} s; a restore's floor (parallel "
                     f"read + pinned H2D) {floor:.2f} s" + "".join(
                         f"; {n} {r['restore_s'] / floor:.2f}x" for n, r in rows.items() if "restore_s" in r
                         and n != "dd"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="model + AdamW state size")
    parser.add_argument("--small", action="store_true", help="20,000 x 1 KiB tensors + AdamW instead")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=None)
    parser.add_argument("--loop-threads", type=int, default=None,
                        help="the training loop's torch threads (default: every core); fewer leaves cores idle")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the state and loop live")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child: one variant, one round
    args = parser.parse_args()
    if args.variant:
        return child(args)
    samples: dict[str, list[dict]] = {}
    variants, failed = args.variants.split(","), {}
    load: list[float] = []
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        "checkpoint_compare_small.json" if args.small else "checkpoint_compare.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:  # rotated order
            if v in failed:
                continue
            cmd = [sys.executable, __file__, "--variant", v, "--gib", str(args.gib), "--rounds", "1",
                   "--device", args.device]
            cmd += (["--small"] if args.small else []) + (["--dir", args.dir] if args.dir else [])
            cmd += ["--loop-threads", str(args.loop_threads)] if args.loop_threads else []
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                  env={**os.environ, **VARIANT_ENV.get(v, {})})
            if proc.returncode:
                failed[v] = (proc.stdout + proc.stderr)[-4000:]
                print(f"{v} failed (left out of the later rounds):\n{failed[v]}", file=sys.stderr, flush=True)
                continue
            samples.setdefault(v, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
            load.append(os.getloadavg()[0])
        medians = {v: {k: statistics.median(s[k] for s in runs if k in s) for k in runs[0]
                       if isinstance(runs[0][k], float)} for v, runs in samples.items()}
        results = {"gib": args.gib, "small": args.small, "rounds": r + 1, "cpus": os.cpu_count(),
                   "loop_threads": args.loop_threads, "device": args.device, "failed": failed,
                   "load_average": [min(load, default=0), max(load, default=0)], "medians": medians,
                   "samples": samples}
        out.write_text(json.dumps(results, indent=1))
        print(f"round {r + 1}: written to {out}", file=sys.stderr, flush=True)
    print(f"load average {min(load, default=0):.1f}-{max(load, default=0):.1f} on {os.cpu_count()} cores")
    print(table(medians))
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
