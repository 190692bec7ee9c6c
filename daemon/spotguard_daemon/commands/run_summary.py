"""What ``spotguard run`` says at the end: launches, preemptions, and the steps and time they cost.

The figures come from the run record the library writes (``$SPOTGUARD_RECORD``, see
:mod:`spotguard._record`), never from what the job prints, and from the exit statuses the supervisor
saw. For each relaunch after a launch that reached step ``N`` and a relaunch that resumed from
step ``R``:

* **steps lost** are ``N - R``: work done after the last commit, done again;
* **time lost** runs from the moment the earlier launch first reached step ``R`` to the moment the
  relaunch first went past it: the work redone, the stop, the relaunch, the load.

A job that writes no record (it does not import spotguard) has no step figures: they are None,
shown as ``?``; the statuses and the wall time are still known.

Exceptions: none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spotguard.exit_codes import EXIT_FORCED, EXIT_PEER_LOST, EXIT_PREEMPTED

__all__ = ["Launch", "summary", "human"]

PREEMPTED = (EXIT_PREEMPTED, EXIT_FORCED, EXIT_PEER_LOST)
"""Statuses of a launch that stopped for an interruption (its own node's, or a peer's): relaunched."""


@dataclass
class Launch:
    """One run of the command: its process, times, exit status and the record events it wrote."""

    index: int
    pid: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    status: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def preempted(self) -> bool:
        """Stopped for an interruption: status 75, 76 or 77 (a peer lost), or any other failure
        after the job recorded a clean stop, a lost peer or a forced exit and no finish (``torchrun``
        exits 1 when its workers exit 75, 76 or 77)."""
        stopped = any(self.first(e) for e in ("stop", "peer_lost", "forced_exit")) and self.first("finish") is None
        return self.status in PREEMPTED or (self.status not in (0, None) and stopped)

    @property
    def peer_lost(self) -> bool:
        """Stopped because another rank or node of the job was lost (77, or its record says so)."""
        return self.status == EXIT_PEER_LOST or self.first("peer_lost") is not None

    @property
    def failed(self) -> bool:
        return self.status not in (0, None) and not self.preempted

    def first(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == name), None)

    @property
    def resumed_from(self) -> int | None:
        """The step this launch resumed from (0: a fresh start); None without a record."""
        start = self.first("start")
        return None if start is None else start.get("resumed_from") or 0

    @property
    def tiers(self) -> list[str]:
        """Where this launch's ranks resumed from (``local``, ``peer``, ``bucket``), each once."""
        return sorted({e["tier"] for e in self.events if e.get("event") == "start" and isinstance(e.get("tier"), str)})

    @property
    def reached(self) -> int | None:
        """The highest step this launch recorded (progress, commit or stop); None without a
        record."""
        steps = [e["step"] for e in self.events if isinstance(e.get("step"), int)]
        return max(steps, default=self.resumed_from)

    def time_at(self, step: int) -> float:
        """When this launch first recorded a step >= ``step`` (its start when it never did)."""
        return next((e["t"] for e in self.events if isinstance(e.get("step"), int)
                     and e["step"] >= step), self.t_start)

    def time_past(self, step: int) -> float:
        """When this launch first recorded progress beyond ``step`` (its end when it never did)."""
        return next((e["t"] for e in self.events if e.get("event") == "progress"
                     and e.get("step", -1) > step), self.t_end)


def _lost(before: Launch, after: Launch) -> tuple[int | None, float | None]:
    reached, resumed = before.reached, after.resumed_from
    if reached is None or resumed is None:
        return None, None
    return max(reached - resumed, 0), max(after.time_past(resumed) - before.time_at(resumed), 0.0)


def _total(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def summary(launches: list[Launch], status: int, wall: float, reason: str) -> dict[str, Any]:
    """The figures of a whole ``spotguard run`` as a JSON-ready dict (the ``--json`` output)."""
    losses = [_lost(a, b) for a, b in zip(launches, launches[1:])]
    finish = next((l.first("finish") for l in reversed(launches) if l.first("finish")), None)
    return {
        "status": status,
        "reason": reason,
        "launches": len(launches),
        "preemptions": sum(l.preempted for l in launches),
        "failures": sum(l.failed for l in launches),
        "steps_lost": _total([s for s, _ in losses]),
        "seconds_lost": _total([t for _, t in losses]),
        "wall_seconds": round(wall, 3),
        "finish": finish and {"step": finish.get("step"), "digest": finish.get("digest")},
        "runs": [{"index": l.index, "pid": l.pid, "status": l.status,
                  "seconds": round(l.t_end - l.t_start, 3), "resumed_from": l.resumed_from,
                  "tiers": l.tiers, "reached": l.reached} for l in launches],
    }


def human(figures: dict[str, Any]) -> str:
    """The summary in one line, for people."""
    lost_t = figures["seconds_lost"]
    steps = "?" if figures["steps_lost"] is None else figures["steps_lost"]
    seconds = "?" if lost_t is None else f"{lost_t:.1f}"
    finish = figures["finish"]
    done = f"; finished at step {finish['step']}" if finish else ""
    off_node = sorted({t for run in figures["runs"] for t in run.get("tiers", ()) if t != "local"})
    if off_node:
        done += f"; resumed from the {' and the '.join(off_node)} tier"
    return (f"{figures['launches']} run(s), {figures['preemptions']} preemption(s), "
            f"{figures['failures']} failure(s); {steps} step(s) and {seconds} s lost to "
            f"relaunches; wall time {figures['wall_seconds']:.1f} s{done}; "
            f"exit {figures['status']} ({figures['reason']})")
