"""The CPU quota of this process's cgroup, and the CPU its cgroup has used: what a container has.

Why: a Kubernetes pod with a CPU limit sees every core of the node in ``/proc/stat`` and in its
affinity, yet the kernel throttles the whole pod, the training loop with it, once the pod uses its
quota. The persist's CPU budget (:mod:`._budget`) must count the pod's quota, not the node's idle
cores. cgroup v2 (``cpu.max``, ``cpu.stat``) and v1 (``cpu.cfs_quota_us``, ``cpuacct.usage``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["Quota", "quota"]

ROOT = Path("/sys/fs/cgroup")


class Quota:
    """``cores``: what the cpu quota allows; ``used()``: CPU seconds the cgroup has used so far."""

    def __init__(self, cores: float, used: Callable[[], float | None]) -> None:
        self.cores, self.used = cores, used


def quota(root: Path = ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> Quota | None:
    """The quota of this process's cgroup (v2 or v1); None without a quota or where unreadable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    v1: dict[str, tuple[str, str]] = {}
    """controller -> (its mount's name, the cgroup's path) of the v1 hierarchies."""
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2].lstrip("/")
        if not controllers:  # v2; in a hybrid layout its cpu controller may be bound to v1 instead
            for directory in (root / path, root):
                if (directory / "cpu.max").exists():
                    return _v2(directory)
        for controller in controllers.split(","):
            v1[controller] = (controllers, path)
    return _v1(root, v1) if "cpu" in v1 else None


def _v2(directory: Path) -> Quota | None:
    try:
        limit, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None

    def used() -> float | None:
        try:
            for line in (directory / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
        return None
    return _made(limit, period, used)


def _v1(root: Path, v1: dict[str, tuple[str, str]]) -> Quota | None:
    cpu = _own(root, *v1["cpu"], "cpu.cfs_quota_us")
    acct = _own(root, *v1["cpuacct"], "cpuacct.usage") if "cpuacct" in v1 else None
    if cpu is None:
        return None
    try:
        limit, period = (cpu / "cpu.cfs_quota_us").read_text().strip(), (cpu / "cpu.cfs_period_us").read_text()
    except OSError:
        return None
    if limit.startswith("-"):
        return None

    def used() -> float | None:
        try:
            return int((acct / "cpuacct.usage").read_text()) / 1e9 if acct is not None else None
        except (OSError, ValueError):
            return None
    return _made(limit, period, used)


def _own(root: Path, mount: str, path: str, name: str) -> Path | None:
    """The v1 directory of this process's cgroup holding ``name``; else its mount's root (a
    container sees its own cgroup there, under another name than /proc/self/cgroup gives)."""
    for directory in (root / mount / path, root / mount):
        if (directory / name).exists():
            return directory
    return None


def _made(limit: str, period: str, used: Callable[[], float | None]) -> Quota | None:
    try:
        cores = int(limit) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return Quota(cores, used) if cores > 0 else None
