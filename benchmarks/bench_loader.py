"""Cost of spotguard.DataLoader's per-sample seeding against torch's DataLoader, same run, same data.

    python benchmarks/bench_loader.py [--items 20000] [--batch 32]

Both loaders read the same in-memory dataset (one small tensor per sample plus a torch.randn
augmentation) in the main process (``num_workers=0``, where the seeding also saves and restores the
global generators once per batch), shuffled; the figure is microseconds per sample, median of 5 epochs.

Then the start of ``--workers`` loader workers, forked and from a forkserver (what spotguard.DataLoader
uses where forking can deadlock, see spotguard._fork), in the same run: seconds from ``iter(loader)``
to its first batch, median of ``--starts`` starts, and the forkserver's first start (the server
started, torch preloaded, as spotguard.DataLoader does when it is built).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy  # noqa: F401  (imported, so its generator is seeded and kept too, as in real jobs)
import torch

import spotguard
from spotguard import _fork


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 16)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] + 0.01 * torch.randn(16)


def per_sample_us(loader, n: int) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _batch in loader:
            pass
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n * 1e6


def first_batch_s(data: Data, batch: int, workers: int, context: str) -> float:
    """Seconds from ``iter(loader)`` to the first batch: the workers' start."""
    loader = torch.utils.data.DataLoader(data, batch_size=batch, num_workers=workers,
                                         multiprocessing_context=context)
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    elapsed = time.perf_counter() - start
    it._shutdown_workers()
    return elapsed


def worker_start(data: Data, batch: int, workers: int, starts: int) -> None:
    fork = [first_batch_s(data, batch, workers, "fork") for _ in range(starts)]
    started = time.perf_counter()
    _fork.start_forkserver(["torch", *_fork.main_modules()])
    first_batch_s(data, batch, workers, "forkserver")
    first = time.perf_counter() - started
    server = [first_batch_s(data, batch, workers, "forkserver") for _ in range(starts)]
    print(f"{workers} workers, first batch: fork {statistics.median(fork):.3f} s, forkserver "
          f"{statistics.median(server):.3f} s (median of {starts}); forkserver's first start "
          f"{first:.2f} s (server start, the script's imports preloaded)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--starts", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = Data(args.items)
    plain = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True)
    ours = spotguard.DataLoader(data, batch_size=args.batch, shuffle=True)
    base, seeded = per_sample_us(plain, args.items), per_sample_us(ours, args.items)
    print(f"torch DataLoader      {base:7.1f} us/sample")
    print(f"spotguard.DataLoader  {seeded:7.1f} us/sample  (+{seeded - base:.1f} us, x{seeded / base:.2f})")
    if args.workers:
        worker_start(data, args.batch, args.workers, args.starts)


if __name__ == "__main__":
    main()
