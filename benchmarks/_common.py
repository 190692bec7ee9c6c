"""Shared parts of the daemon benchmarks: real simulator and daemon processes, a SUB client, results.

Every benchmark drives real processes on this machine: a simulator (``python -m
spotguard_daemon.simulator``) on a loopback port, the daemon (``python -m spotguard_daemon daemon``)
with its platform endpoint pointed at that simulator, and ZeroMQ SUB sockets in the benchmark
process. Times are wall clock (``time.time()``) on one machine, so the simulator's ``flipped_at``
and a receipt time are directly comparable.

Results go to ``benchmarks/results/<name>.json`` (or ``--out``) and a markdown table to stdout.

Exceptions::

    BenchError               a process did not start, or an expected event did not arrive in time
"""

from __future__ import annotations

import json
import math
import os
import platform as _platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import httpx
import zmq
from spotguard.protocol import decode_event

__all__ = [
    "BenchError", "SimProcess", "DaemonProcess", "Subscriber", "summarize", "write_results",
    "markdown_table", "machine", "RESULTS_DIR", "ENDPOINT_PATHS",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"

ENDPOINT_PATHS = {"aws": "", "gcp": "/computeMetadata/v1", "azure": "", "alibaba": ""}
"""What each platform's endpoint setting appends to the simulator's base URL."""


class BenchError(RuntimeError):
    """A benchmark process did not start, or an expected event did not arrive in time."""


class SimProcess:
    """A simulator of ``platform`` in its own process; :attr:`url` once it printed its listening line."""

    def __init__(self, platform: str, **options: Any) -> None:
        args = [arg for key, value in options.items() for arg in ("-o", f"{key}={json.dumps(value)}")]
        self.platform = platform
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spotguard_daemon.simulator", platform, "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if " listening on " not in line:
            self.stop()
            raise BenchError(f"simulator {platform} did not start: {line!r}")
        self.url = line.split(" listening on ", 1)[1].split()[0]
        self.http = httpx.Client(base_url=self.url, timeout=5.0)

    def control(self, op: str, body: dict[str, Any] | None = None) -> Any:
        """One ``/_sim/<op>`` call (``state`` is a GET, the rest POST); raises on a non-200 answer."""
        reply = self.http.get("/_sim/state") if op == "state" else self.http.post(f"/_sim/{op}", json=body or {})
        reply.raise_for_status()
        return reply.json()

    def flipped_at(self, event_id: str) -> float:
        for event in self.control("state")["events"]:
            if event["id"] == event_id and event["flipped_at"] is not None:
                return event["flipped_at"]
        raise BenchError(f"event {event_id} has not flipped")

    def stop(self) -> None:
        if getattr(self, "http", None) is not None:
            self.http.close()
        _terminate(self.proc)


class DaemonProcess:
    """The daemon watching ``platform`` at ``endpoint`` (or ``none``), sockets in a short private dir.

    ``ipc://`` paths must stay under about 107 bytes, hence a fresh ``/tmp/sgb-*`` directory (0700,
    removed by :meth:`stop`). The state directory (where the store fsyncs ``notices.json`` before it
    publishes) lives there too, or under ``state_base`` (e.g. ``/dev/shm``, to show the cost of the
    fsyncs by comparison).
    """

    def __init__(self, platform: str = "none", endpoint: str | None = None,
                 env: dict[str, str] | None = None, state_base: str | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sgb-", dir="/tmp"))
        self.state_dir = Path(tempfile.mkdtemp(prefix="sgb-", dir=state_base)) if state_base else self.dir / "state"
        self.runtime_dir = self.dir / "run"
        # The simulated GCP VM says preemptible: the legacy 24 h cap counts from this host's boot,
        # so a host up a day would see a walltime notice before any the benchmark flips.
        full_env = {**os.environ, "SPOTGUARD_GCP__PREEMPTIBLE": "no", **(env or {})}
        if endpoint is not None:
            full_env[f"SPOTGUARD_{platform.upper()}__ENDPOINT"] = endpoint
        self.log = open(self.dir / "daemon.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spotguard_daemon", "daemon", "--platform", platform,
             "--runtime-dir", str(self.runtime_dir), "--state-dir", str(self.state_dir),
             "--metrics-port", "0", "--log-level", "WARNING"],
            env=full_env, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def pub_endpoint(self) -> str:
        return f"ipc://{self.runtime_dir}/events.sock"

    @property
    def request_endpoint(self) -> str:
        return f"ipc://{self.runtime_dir}/requests.sock"

    def output(self) -> str:
        return (self.dir / "daemon.log").read_text(errors="replace")

    def stop(self) -> None:
        _terminate(self.proc)
        self.log.close()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _terminate(proc: subprocess.Popen) -> None:
    """SIGINT twice (the daemon's second signal exits at once), then SIGKILL after 10 s."""
    for sig in (signal.SIGINT, signal.SIGINT):
        if proc.poll() is None:
            proc.send_signal(sig)
            time.sleep(0.05)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Subscriber:
    """A SUB socket on the daemon's PUB endpoint that has seen one heartbeat (so it is connected)."""

    def __init__(self, ctx: zmq.Context, daemon: DaemonProcess, timeout: float = 20.0) -> None:
        self.daemon = daemon
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(daemon.pub_endpoint)
        self.wait("heartbeat", timeout=timeout)

    def wait(self, topic: str, match: Callable[[Any], bool] = lambda event: True,
             timeout: float = 10.0) -> tuple[Any, float]:
        """The next ``topic`` event that ``match`` accepts and ``time.time()`` right after its receipt."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000) + 1):
                got, data = self.sock.recv_multipart()
                received = time.time()
                if got == topic.encode() and match(event := decode_event(data)):
                    return event, received
        if self.daemon.proc.poll() is not None:
            raise BenchError(f"the daemon exited {self.daemon.proc.returncode}: {self.daemon.output()[-2000:]}")
        raise BenchError(f"no {topic} event within {timeout} s")

    def close(self) -> None:
        self.sock.close(linger=0)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the value below which ``q`` percent of samples lie, no interpolation)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summarize(samples_ms: Sequence[float]) -> dict[str, Any]:
    """Count, p50, p99, max and mean of samples in milliseconds (rounded to 0.01 ms)."""
    if not samples_ms:
        return {"n": 0}
    stats = {"p50_ms": percentile(samples_ms, 50), "p99_ms": percentile(samples_ms, 99),
             "max_ms": max(samples_ms), "mean_ms": sum(samples_ms) / len(samples_ms)}
    return {"n": len(samples_ms), **{key: round(value, 2) for key, value in stats.items()}}


def machine() -> dict[str, Any]:
    """Where the figures were taken: CPU count, model, Python, and the file system of /tmp."""
    model = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                  if line.startswith("model name")), "unknown")
    tmpfs = next((line.split()[2] for line in _read_lines("/proc/mounts") if line.split()[1:2] == ["/tmp"]), "")
    load = " ".join(next(iter(_read_lines("/proc/loadavg")), "").split()[:3])
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": _platform.python_version(),
            "tmp_fs": tmpfs or "root fs", "loadavg_1_5_15": load,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _read_lines(path: str) -> Iterable[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def write_results(name: str, data: dict[str, Any], out: Path | None = None) -> Path:
    """Write ``data`` plus the machine description to ``out`` or ``results/<name>.json``."""
    path = out or RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **data}, indent=2) + "\n")
    return path


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
