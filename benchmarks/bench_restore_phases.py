"""Where a cold restore's time goes: read and verify, then the copy into the live state.

One process, one state (``bench_checkpoint_compare``'s model plus AdamW, on ``--device``), saved
once by an uncapped Checkpointer. Then, each from a cold cache: ``read_entries`` (read and verify
every file into page-aligned host buffers), ``restore`` from them (``load_state_dict``: with CUDA
state the host-to-device copy from pageable memory), the same ``restore`` warm, and
``Checkpointer.load_latest`` whole with the default budget and uncapped, then both again (each
followed by the wait for the staging buffers it prepares in the background; with its page faults:
the first restore of a process reads into fresh memory, a later one may reuse what an earlier one
freed, so order alone can set the gap between two arms). With CUDA state, first a design to
measure (:func:`pinned_read`: the same read into pinned buffers allocated as the reads go, then the
copy from them), then the yardsticks of the copy: allocating pinned buffers for the whole state, a
pinned host-to-device copy and a pageable one.

    python benchmarks/bench_restore_phases.py --device cuda --gib 8
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

import bench_checkpoint_compare as compare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from spotguard.checkpoint import Checkpointer, load

    compare.DEVICE = args.device
    work, res = Path(tempfile.mkdtemp(prefix="phases-", dir=args.dir)), {"gib": args.gib, "device": args.device}
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"restore_phases_{args.device}.json"

    def timed(name: str, fn):
        compare.sync()
        began = time.perf_counter()
        value = fn()
        compare.sync()
        res[name] = time.perf_counter() - began
        print(f"{name}: {res[name]:.3f} s", flush=True)
        out.write_text(json.dumps(res, indent=1))  # after every phase: a run cut short keeps them
        return value
    try:
        model, opt = timed("build_s", lambda: compare.build(args.gib, False))
        state = {"model": model, "optimizer": opt}
        with Checkpointer(work / "ck", keep=1, background_nice=None, background_cpu_share=None) as ck:
            timed("save_uncapped_s", lambda: ck.save(1, state, blocking=True))
        path = next((work / "ck").glob("step-*"))
        compare.evict(path)
        manifest = load.read_manifest(path)
        entries = timed("read_entries_cold_s", lambda: load.read_entries(path, manifest, "rank-0", verify=True))
        timed("restore_from_buffers_s", lambda: load.restore(state, entries))
        timed("restore_from_buffers_warm_s", lambda: load.restore(state, entries))
        entries = None  # the read buffers go before the pinned yardsticks
        tensors = [t for t in compare.state_tensors(model, opt) if t.is_cuda]
        if tensors:  # before the yardsticks, whose pinned blocks torch would cache and hand back
            pinned_read(path, manifest, state, timed, res)
            pinned = timed("pinned_alloc_s", lambda: [torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                                      for t in tensors])
            timed("h2d_pinned_s", lambda: [d.copy_(s, non_blocking=True) for d, s in zip(tensors, pinned)])
            pageable = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
            timed("h2d_pageable_s", lambda: [d.copy_(s) for d, s in zip(tensors, pageable)])
            del pinned, pageable
        uncapped = {"background_nice": None, "background_cpu_share": None}
        for label, kwargs in (("default", {}), ("uncapped", uncapped), ("default_again", {}),
                              ("uncapped_again", uncapped)):
            compare.evict(path)
            ck = Checkpointer(work / "ck", keep=1, **kwargs)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            timed(f"load_latest_{label}_s", lambda: ck.load_latest(state))
            res[f"load_latest_{label}_page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            timed(f"load_latest_{label}_then_prepared_s", ck._stager.wait_prepared)
            ck.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.write_text(json.dumps(res, indent=1))


def pinned_read(path: Path, manifest: dict, state: dict, timed, res: dict) -> None:
    """The restore's design to measure with CUDA state: the same cold read and check, into pinned
    buffers allocated file by file as the reads go (``load.aligned_bytes`` swapped for a pinned
    allocation here only), then the copy into the live CUDA state from them. A failure is recorded,
    not raised: the later phases still run."""
    from spotguard.checkpoint import load

    original = load.aligned_bytes
    load.aligned_bytes = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    try:
        compare.evict(path)
        entries = timed("read_entries_pinned_cold_s",
                        lambda: load.read_entries(path, manifest, "rank-0", verify=True))
        timed("restore_from_pinned_buffers_s", lambda: load.restore(state, entries))
    except Exception as exc:  # noqa: BLE001 - a measurement, not the product
        res["pinned_read_error"] = repr(exc)
    finally:
        load.aligned_bytes = original


if __name__ == "__main__":
    main()
