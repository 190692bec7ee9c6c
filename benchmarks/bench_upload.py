"""Durable-upload benchmark against the S3 emulator (moto_server on 127.0.0.1).

Four questions, each against a fresh bucket:

1. Upload throughput of ``Durable.upload`` (hash new files, tuned multipart, parallel files) versus a
   tuned boto3 ``upload_file`` per file (same ``TransferConfig``, files one after another) and a
   single-stream ``put_object`` per file.
2. Bytes uploaded for a fine-tune-like state where 90% of the tensors are frozen: the second and
   later checkpoints send only the trainable 10%.
3. Restore time of the checkpoint (parallel downloads + sha256 of every file + atomic commit) versus
   a plain sequential ``download_file`` of each object with no verification.
4. Training step-time inflation while the REAL daemon uploads (target: at most 10 %): a one-thread
   CPU training loop (small MLP) measures its median step time idle and while the daemon (a
   subprocess, ``--platform none``) makes a checkpoint committed through a ``CommitRequest`` durable
   in the emulator and in a ``file://`` store, each with the daemon's upload threads at normal and at
   lowered CPU priority (``storage.upload_nice``). The daemon's and the emulator's CPU seconds over
   the upload come from ``/proc/<pid>/stat``, so the daemon's own share is visible (``_upload_inflation``).
   The emulator competes for these 2 cores as a remote bucket would not, so a last S3 run sets the
   emulator at nice 19 too; ``file://`` measures the daemon alone.

The emulator is a Python process on the same 2-core machine, so absolute figures are far below a
real S3 endpoint; the ratios are what the benchmark is for. Usage::

    python benchmarks/bench_upload.py [--size-mb 1024] [--files 8] [--out benchmarks/results/upload.json]
    python benchmarks/bench_upload.py --quick --out /tmp/upload.json   # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from _common import markdown_table
from _upload_inflation import Inflation, TrainLoop, renice
from spotguard.storage import Durable, StoreOptions, open_store

HERE = Path(__file__).resolve().parent
MB = 1024 * 1024


def start_moto(workdir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    binary = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    log = open(workdir / "moto.log", "wb")
    proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def write_checkpoint(root: Path, step: int, files: dict[str, Path | bytes]) -> Path:
    """A committed local checkpoint; ``Path`` values are hard-linked (frozen tensors reuse bytes)."""
    import hashlib

    ckpt = root / f"step-{step:010d}"
    ckpt.mkdir(parents=True)
    table = {}
    for rel, src in files.items():
        dest = ckpt / rel
        os.link(src, dest) if isinstance(src, Path) else dest.write_bytes(src)
        digest = hashlib.sha256()
        with open(dest, "rb") as f:
            while block := f.read(8 * MB):
                digest.update(block)
        table[rel] = {"size": dest.stat().st_size, "sha256": digest.hexdigest()}
    manifest = {"format": "spotguard-checkpoint", "version": 1, "step": step, "files": table}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class Bench:
    def __init__(self, endpoint: str, work: Path, options: StoreOptions) -> None:
        self.endpoint, self.work, self.options = endpoint, work, options
        self.counter = 0

    def bucket(self) -> Any:
        self.counter += 1
        store = open_store(f"s3://bench-{self.counter}-{os.getpid()}/p", self.options)
        store._client.create_bucket(Bucket=store.bucket)
        return store

    def throughput(self, ckpt: Path, total: int) -> dict[str, float]:
        files = sorted(p for p in ckpt.iterdir() if p.name != "manifest.json")
        ours = self.bucket()
        t_ours, _ = timed(lambda: Durable(ours, concurrency=self.options.concurrency).upload(ckpt, "bench"))
        tuned = self.bucket()
        t_tuned, _ = timed(lambda: [tuned._client.upload_file(str(p), tuned.bucket, f"t/{p.name}", Config=tuned._transfer)
                                    for p in files])
        single = self.bucket()

        def put_all() -> None:
            for p in files:
                with open(p, "rb") as body:
                    single._client.put_object(Bucket=single.bucket, Key=f"s/{p.name}", Body=body)

        t_single, _ = timed(put_all)
        self.restore_bucket = ours
        return {name: round(total / MB / t, 1) for name, t in
                (("durable_upload_MBps", t_ours), ("boto3_upload_file_tuned_MBps", t_tuned),
                 ("put_object_single_stream_MBps", t_single))}

    def restore(self, ckpt: Path, total: int) -> dict[str, float]:
        store = self.restore_bucket
        durable = Durable(store, concurrency=self.options.concurrency)
        t_ours, _ = timed(lambda: durable.restore("bench", self.work / "restored"))
        plain = self.work / "plain"
        plain.mkdir()
        manifest = json.loads((ckpt / "manifest.json").read_text())

        def sequential() -> None:
            for rel, meta in manifest["files"].items():
                store._client.download_file(store.bucket, f"p/objects/sha256/{meta['sha256']}", str(plain / rel))

        t_plain, _ = timed(sequential)
        return {"durable_restore_s": round(t_ours, 2), "durable_restore_MBps": round(total / MB / t_ours, 1),
                "sequential_download_s": round(t_plain, 2), "sequential_download_MBps": round(total / MB / t_plain, 1)}

    def finetune(self, tensors: int, tensor_mb: int, steps: int) -> dict[str, Any]:
        src = self.work / "ft-src"
        src.mkdir()
        frozen = {}
        for i in range(tensors - max(1, tensors // 10)):
            (src / f"frozen{i}.bin").write_bytes(os.urandom(tensor_mb * MB))
            frozen[f"frozen{i}.bin"] = src / f"frozen{i}.bin"
        durable, rows = Durable(self.bucket()), []
        for step in range(1, steps + 1):
            trainable = {f"trainable{i}.bin": os.urandom(tensor_mb * MB) for i in range(max(1, tensors // 10))}
            info = durable.upload(write_checkpoint(self.work / "ft", step, frozen | trainable), "ft")
            rows.append({"step": step, "bytes_total": info.bytes_total, "bytes_uploaded": info.bytes_uploaded,
                         "fraction_uploaded": round(info.bytes_uploaded / info.bytes_total, 3),
                         "seconds": round(info.seconds, 2)})
        return {"tensors": tensors, "tensor_MB": tensor_mb, "frozen_fraction": 0.9, "checkpoints": rows}


def inflation(bench: Bench, ckpt: Path, emulator_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """Question 4 against the emulator and ``file://``, the daemon's upload threads at each nice."""
    probe = Inflation(TrainLoop(), ckpt, emulator_pid, args.idle_s)
    runs: dict[str, Any] = {}
    for nice in args.nice:
        env = {"SPOTGUARD_STORAGE__UPLOAD_NICE": str(nice)}
        if "s3" in args.backends:
            s3 = bench.bucket()
            env_s3 = {**env, "SPOTGUARD_STORAGE__ENDPOINT_URL": bench.endpoint}
            runs[f"s3_nice{nice}"] = probe.measure(f"s3://{s3.bucket}/p", env_s3)
        if "file" in args.backends:
            folder = bench.work / f"file-store-nice{nice}"
            runs[f"file_nice{nice}"] = probe.measure(f"file://{folder}", env)
            shutil.rmtree(folder, ignore_errors=True)
    if "s3" in args.backends:  # a real bucket works elsewhere: here the emulator yields to training
        renice(emulator_pid, 19)
        env = {"SPOTGUARD_STORAGE__UPLOAD_NICE": str(args.nice[-1]), "SPOTGUARD_STORAGE__ENDPOINT_URL": bench.endpoint}
        runs[f"s3_nice{args.nice[-1]}_emulator_nice19"] = probe.measure(f"s3://{bench.bucket().bucket}/p", env)
    return {"target_max_inflation_pct": 10, "train_loop": "MLP 256-1024-1024-10, batch 64, SGD, torch threads=1",
            "checkpoint_MB": probe.size // MB, "runs": runs}


def table(result: dict[str, Any]) -> str:
    rows = [(name, r["idle_p50_ms"], r["upload_p50_ms"], r["inflation_pct"], r["upload_s"], r["daemon_cpu_s"],
             r["daemon_cpu_cores"], r["emulator_cpu_s"], r["other_processes_cpu_cores"])
            for name, r in result["runs"].items()]
    return markdown_table(("run", "idle p50 ms", "upload p50 ms", "inflation %", "upload s", "daemon CPU s",
                           "daemon cores", "emulator CPU s", "other processes' cores"), rows)


PARTS = ("upload", "restore", "finetune", "inflation")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--part-mb", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=4.0, help="idle training seconds before and after each upload")
    parser.add_argument("--nice", default="0,10,19", help="storage.upload_nice values to compare")
    parser.add_argument("--backends", default="s3,file", help="stores the daemon uploads to (question 4)")
    parser.add_argument("--parts", default=",".join(PARTS), help="which questions to run; the others' "
                        "figures are kept from --out")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 32 MB, short loops")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "upload.json")
    args = parser.parse_args()
    if args.quick:
        args.size_mb, args.files, args.idle_s, args.part_mb = 32, 4, 0.5, 8
    args.parts = [part for part in args.parts.split(",") if part]
    args.nice = tuple(int(n) for n in args.nice.split(","))
    args.backends = args.backends.split(",")
    return args


def run(args: argparse.Namespace, work: Path, results: dict[str, Any]) -> None:
    proc, url = start_moto(work)
    try:
        options = StoreOptions(endpoint_url=url, concurrency=args.concurrency, part_size=args.part_mb * MB)
        bench = Bench(url, work, options)
        per_file = args.size_mb // args.files
        ckpt = write_checkpoint(work / "local", 1, {f"shard{i}.bin": os.urandom(per_file * MB) for i in range(args.files)})
        total = per_file * args.files * MB
        results.update({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                    "platform": platform.platform()},
                        "emulator": "moto_server (same machine)", "checkpoint_MB": total // MB, "files": args.files,
                        "part_MB": args.part_mb, "concurrency": args.concurrency})
        if "upload" in args.parts or "restore" in args.parts:
            results["upload"] = bench.throughput(ckpt, total)
        if "restore" in args.parts:
            results["restore"] = bench.restore(ckpt, total)
        if "finetune" in args.parts:
            results["finetune"] = bench.finetune(*((4, 1, 2) if args.quick else (20, 8, 3)))
        if "inflation" in args.parts:
            results["step_time_inflation"] = inflation(bench, ckpt, proc.pid, args)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    args = parse_args()
    for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    results = json.loads(args.out.read_text()) if args.out.exists() and set(args.parts) != set(PARTS) else {}
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-upload-") as tmp:
        run(args, Path(tmp), results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    if "step_time_inflation" in results:
        print(table(results["step_time_inflation"]))


if __name__ == "__main__":
    main()
