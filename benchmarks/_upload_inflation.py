"""Question 4 of :mod:`bench_upload`: how much a training loop slows while the real daemon uploads.

:class:`TrainLoop` is a one-thread CPU training loop (torch, MLP); :class:`Inflation` runs it idle,
then while a daemon subprocess makes a checkpoint committed through a ``CommitRequest`` durable,
then idle again, and compares the median step times. :class:`CpuMeter` reads ``/proc`` so the
daemon's own CPU seconds, the emulator's, and those of every other process on the machine are in
the result next to the inflation (on a shared 2-core machine the last one says how much to trust it).

Exceptions: ``RuntimeError`` when the daemon refuses or does not answer the commit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import zmq
from _common import DaemonProcess, Subscriber
from spotguard.protocol import CommitRequest, decode_reply, encode

__all__ = ["CpuMeter", "Inflation", "TrainLoop", "cpu_seconds", "renice", "threads_by_nice"]

MB = 1024 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def threads_by_nice(pid: int) -> dict[str, int]:
    """How many threads of ``pid`` run at each nice value (Linux niceness is per thread)."""
    counts: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            nice = (task / "stat").read_text().rsplit(")", 1)[1].split()[16]
        except OSError:
            continue  # the thread ended
        counts[nice] = counts.get(nice, 0) + 1
    return counts


def renice(pid: int, nice: int) -> None:
    """Set the niceness of every thread of ``pid`` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
        except (OSError, ValueError):
            continue  # the thread ended


class CpuMeter:
    """CPU seconds of named processes since it was made, and the cores that every OTHER process on
    the machine used meanwhile (``/proc/stat`` minus the named ones): a figure taken while other
    work ran shows it."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.started = pids, time.monotonic()
        self.start = self._sample()

    def _sample(self) -> dict[str, float]:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        return {**{name: cpu_seconds(pid) for name, pid in self.pids.items()}, "machine": busy / CLK_TCK}

    def read(self) -> dict[str, float]:
        now, wall = self._sample(), time.monotonic() - self.started
        used = {name: now[name] - self.start[name] for name in now}
        others = used.pop("machine") - sum(used.values())
        return {**{f"{name}_cpu_s": round(value, 2) for name, value in used.items()},
                "other_processes_cpu_cores": round(max(others, 0.0) / wall, 2)}


class TrainLoop:
    """A one-thread CPU training loop (MLP 256-1024-1024-10, batch 64, SGD): the victim whose
    median step time the uploads must not inflate by more than 10 %."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(0)
        nn = torch.nn
        self.torch = torch
        self.model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                   nn.Linear(1024, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x, self.y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        self.run(0.5)  # warm-up

    def step(self) -> float:
        start = time.perf_counter()
        self.opt.zero_grad()
        self.torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()
        return (time.perf_counter() - start) * 1000

    def run(self, seconds: float, stop: Callable[[], bool] = lambda: False) -> list[float]:
        """Step times (ms) for ``seconds``, or until ``stop()`` is true (checked after each step)."""
        times, end = [], time.monotonic() + seconds
        while time.monotonic() < end and not stop():
            times.append(self.step())
        return times


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


class Inflation:
    """Step-time inflation of :class:`TrainLoop` while the real daemon uploads ``ckpt``."""

    def __init__(self, loop: TrainLoop, ckpt: Path, emulator_pid: int, idle_s: float) -> None:
        self.loop, self.ckpt, self.emulator_pid, self.idle_s = loop, ckpt, emulator_pid, idle_s
        self.size = sum(p.stat().st_size for p in ckpt.iterdir())

    def measure(self, store_url: str, env: dict[str, str]) -> dict[str, Any]:
        """One daemon on ``store_url``: idle steps, one commit and steps until it is durable, idle
        steps again. Inflation is the median step time during the upload over the idle median."""
        env = {"SPOTGUARD_CHECKPOINT_ROOT": str(self.ckpt.parent), "SPOTGUARD_STORAGE__URL": store_url, **env}
        daemon, ctx = DaemonProcess(env=env), zmq.Context()
        try:
            sub = Subscriber(ctx, daemon)
            meter = CpuMeter({"daemon": daemon.proc.pid, "emulator": self.emulator_pid, "bench": os.getpid()})
            idle = self.loop.run(self.idle_s)
            others_idle = meter.read()["other_processes_cpu_cores"]
            row = self._upload(daemon, sub)
            idle += self.loop.run(self.idle_s)
        finally:
            daemon.stop()
            ctx.destroy(linger=0)
        during = row.pop("steps")
        base, busy = median(idle), median(during)
        return {"idle_p50_ms": round(base, 3), "upload_p50_ms": round(busy, 3),
                "inflation_pct": round((busy / base - 1) * 100, 1), "steps_idle": len(idle),
                "steps_during_upload": len(during), **row, "other_processes_cpu_cores_idle": others_idle}

    def _upload(self, daemon: DaemonProcess, sub: Subscriber) -> dict[str, Any]:
        meter = CpuMeter({"daemon": daemon.proc.pid, "emulator": self.emulator_pid, "bench": os.getpid()})
        nices: dict[str, int] = {}
        request = CommitRequest(pid=os.getpid(), job_id="bench", path=str(self.ckpt), step=1, size_bytes=self.size)
        with zmq.Context() as ctx, ctx.socket(zmq.REQ) as req:
            req.setsockopt(zmq.LINGER, 0)
            req.connect(daemon.request_endpoint)
            req.send(encode(request))
            if not req.poll(10_000) or not decode_reply(req.recv()).ok:
                raise RuntimeError(f"commit refused or unanswered: {daemon.output()[-1000:]}")

        def durable() -> bool:
            for nice, count in threads_by_nice(daemon.proc.pid).items():  # most threads seen at once
                nices[nice] = max(count, nices.get(nice, 0))
            while sub.sock.poll(0):
                if sub.sock.recv_multipart()[0] == b"durable":
                    return True
            return False

        steps = self.loop.run(600, stop=durable)
        wall, cpu = time.monotonic() - meter.started, meter.read()
        return {"steps": steps, "upload_s": round(wall, 2), "upload_MBps": round(self.size / MB / wall, 1),
                **cpu, "daemon_cpu_cores": round(cpu["daemon_cpu_s"] / wall, 2),
                "daemon_threads_by_nice": dict(sorted(nices.items(), key=lambda kv: int(kv[0])))}
