"""What ``spotguard drill`` concludes from the run records of its launches.

Everything here reads only what the library appended to ``$SPOTGUARD_RECORD``
(:mod:`spotguard._record`), never what the job prints: a job cannot pass by printing the right line.
:func:`judge` turns the launches of one drill (and the reference run, when there was one) into
:class:`Check` results, each with a diagnosis written for the person who owns the job, and
:func:`losses` into the cost of each preemption, set against the Young/Daly prediction for the
save cost the records measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.cadence import DEFAULT_NODE_MTBF_S, expected_waste, young_interval

__all__ = ["Check", "Launch", "judge", "losses", "save_figures"]

WARNED = ("notice", "sigterm")
"""Preemption kinds that leave room to save: they must lose no step."""


@dataclass
class Launch:
    """One run of the user's command: what the drill did to it and what the library recorded."""

    index: int
    kind: str | None = None
    """The preemption planned for it (notice, short-notice, sigterm, sigkill), None for none."""
    target: int | None = None
    log: Path | None = None
    t_launch: float = 0.0
    t_end: float = 0.0
    status: int | None = None
    preempted_at: float | None = None
    killed: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)

    def first(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == name and e.get("rank", 0) == 0), None)

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name and e.get("rank", 0) == 0]

    @property
    def started(self) -> bool:
        return self.first("start") is not None

    @property
    def resumed_from(self) -> int:
        start = self.first("start") or {}
        return start.get("resumed_from") or 0

    @property
    def reached(self) -> int:
        """The furthest step this launch is known to have completed."""
        steps = [e.get("step", 0) for e in self.events if e["event"] in ("progress", "stop", "commit",
                                                                         "finish")]
        return max(steps, default=self.resumed_from)

    @property
    def preempted(self) -> bool:
        return self.preempted_at is not None

    def point(self) -> dict[str, Any]:
        """The launch for the JSON report, without its raw events."""
        return {"launch": self.index, "preemption": self.kind if self.preempted else None,
                "target_step": self.target, "status": self.status, "killed": self.killed,
                "resumed_from": self.first("start") and self.first("start").get("resumed_from"),
                "reached": self.reached, "seconds": round(self.t_end - self.t_launch, 3),
                "log": str(self.log) if self.log else None}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def judge(launches: list[Launch], reference: Launch | None) -> list[Check]:
    """The drill's verdict, check by check; a failed check's ``detail`` says what to fix."""
    checks = [_started(launches), _fresh(launches[0]), _resumes(launches), _loads(launches),
              _warned(launches), _finished(launches[-1])]
    preempted = sum(launch.preempted for launch in launches)
    checks.append(Check("preempted", preempted > 0, f"{preempted} preemption(s)" if preempted else
                        "the job ended before the first preemption: make it longer (more steps) "
                        "or the drill has nothing to prove"))
    if reference is not None:
        checks.append(_identical(launches, reference))
    return checks


def _started(launches: list[Launch]) -> Check:
    silent = [launch for launch in launches if not launch.started]
    if not silent:
        return Check("recorded", True, "every launch recorded its start")
    first = silent[0]
    return Check("recorded", False, f"launch {first.index} exited with status {first.status} "
                 "without starting a spotguard run (no start event): the command must train "
                 f"through spotguard.Run (or call its record); see {first.log}")


def _fresh(first: Launch) -> Check:
    start = first.first("start") or {}
    if start.get("resumed_from") is None:
        return Check("fresh start", True, "the first launch started from step 0")
    return Check("fresh start", False, f"the first launch resumed from step {start['resumed_from']}: "
                 f"{start.get('root')} already held checkpoints; point the job at an empty "
                 "checkpoint directory (the drill must see the whole run)")


def _resumes(launches: list[Launch]) -> Check:
    """Each relaunch must load the newest commit recorded before it (or a newer one, whose
    record line a kill cut off), never an older one, never step 0 after a commit."""
    committed = 0
    for before, launch in zip(launches, launches[1:]):
        committed = max([committed, *(c["step"] for c in before.of("commit"))])
        if launch.started and launch.resumed_from < committed:
            how = "from scratch" if launch.resumed_from == 0 else f"from step {launch.resumed_from}"
            return Check("resume", False, f"launch {launch.index} started {how} although step "
                         f"{committed} was committed: the job does not resume from its newest "
                         "checkpoint (does it delete or change its checkpoint directory at start, "
                         "or skip loading?)")
    return Check("resume", True, "every relaunch resumed from the newest committed checkpoint")


def _loads(launches: list[Launch]) -> Check:
    for launch in launches:
        for event in launch.of("load_failed"):
            return Check("loads", False, f"launch {launch.index} could not load its checkpoint: "
                         f"{event.get('error')}")
        start = launch.first("start") or {}
        for skipped in start.get("skipped") or []:
            return Check("loads", False, f"launch {launch.index} skipped a corrupt checkpoint "
                         f"{skipped.get('path')}: {skipped.get('reason')}")
    return Check("loads", True, "no checkpoint failed to load")


def _warned(launches: list[Launch]) -> Check:
    for launch, after in zip(launches, launches[1:]):
        if launch.preempted and launch.kind in WARNED and after.resumed_from < launch.reached:
            lost = launch.reached - after.resumed_from
            how = "a daemon notice with room to save" if launch.kind == "notice" else "SIGTERM"
            return Check("saves on warning", False, f"launch {launch.index} lost {lost} step(s) to "
                         f"{how}: the job did not save before exiting (is spotguard.Run's loop "
                         "reached promptly, and does the job let it handle SIGTERM?)")
    return Check("saves on warning", True, "warned preemptions lost no step")


def _finished(last: Launch) -> Check:
    if last.first("finish") is not None and last.status == 0:
        return Check("finished", True, f"the job finished at step {last.first('finish')['step']}")
    return Check("finished", False, f"the last launch exited with status {last.status} without "
                 f"finishing; see {last.log}")


def _identical(launches: list[Launch], reference: Launch) -> Check:
    last = launches[-1]
    mine, theirs = last.first("finish"), reference.first("finish")
    if theirs is None:
        return Check("identical", False, "the uninterrupted reference run did not finish; "
                     f"see {reference.log}")
    if mine is None or mine.get("digest") == theirs.get("digest"):
        return Check("identical", mine is not None, "final state bit-identical to the "
                     f"uninterrupted run (digest {theirs.get('digest', '')[:16]})" if mine else
                     "no final state to compare")
    entries = (last.first("start") or {}).get("entries")
    holds = f" Its checkpoint holds: {', '.join(entries)}." if entries else ""
    return Check("identical", False, "the final training state differs from the uninterrupted "
                 "run's: something the job depends on is not in its checkpoint (the optimizer, "
                 "the scheduler, the data position, or an RNG: e.g. a DataLoader whose shuffling "
                 "draws from the global RNG); pass every stateful object to spotguard.Run."
                 + holds + _diverged(launches, reference))


def _diverged(launches: list[Launch], reference: Launch) -> str:
    """Where the drilled states left the reference's: the first step both runs committed with
    different digests, the last equal one before it, and the relaunch in between."""
    theirs = {c["step"]: c["digest"] for c in reference.of("commit")}
    mine = {c["step"]: c["digest"] for launch in launches for c in launch.of("commit")}
    common = sorted(set(theirs) & set(mine))
    differ = [step for step in common if theirs[step] != mine[step]]
    if not differ:
        return ""
    equal = max((s for s in common if s < differ[0] and theirs[s] == mine[s]), default=0)
    text = f" Both runs were identical at step {equal} and differ at step {differ[0]}"
    culprit = next((launch for launch in launches[1:] if equal <= launch.resumed_from < differ[0]),
                   None)
    if culprit is not None:
        text += (f", after launch {culprit.index} resumed from step {culprit.resumed_from}: "
                 "what diverges is the resume")
    return text + "."


def save_figures(launches: list[Launch]) -> dict[str, float | None]:
    """Measured save cost C (median blocking+persist s) and save interval T (median seconds
    between consecutive periodic commits of one launch), and Young's optimum for C."""
    commits = [c for launch in launches for c in launch.of("commit")]
    costs = [c.get("blocking_s", 0) + c.get("persist_s", 0) for c in commits]
    gaps = [b["t"] - a["t"] for launch in launches
            for a, b in zip(launch.of("commit"), launch.of("commit")[1:]) if b.get("kind") == "periodic"]
    cost = statistics.median(costs) if costs else None
    interval = statistics.median(gaps) if gaps else None
    young = young_interval(DEFAULT_NODE_MTBF_S, cost) if cost else None
    waste = expected_waste(interval, DEFAULT_NODE_MTBF_S, cost) if cost and interval else None
    return {"save_cost_s": cost, "save_interval_s": interval, "young_interval_s": young,
            "mtbf_s": DEFAULT_NODE_MTBF_S, "expected_waste": waste}


def losses(launches: list[Launch], figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Steps and seconds each preemption cost, against the prediction: an unwarned preemption at a
    uniformly random instant loses half a save interval (Young/Daly's rework term), a warned one
    nothing; plus the restart (kill to the relaunch's start)."""
    step_s = _step_seconds(launches)
    rows = []
    for launch, after in zip(launches, launches[1:]):
        if not launch.preempted:
            continue
        lost = max(0, launch.reached - after.resumed_from)
        start = after.first("start")
        restart = (start["t"] if start else after.t_launch) - launch.preempted_at
        interval = figures.get("save_interval_s")
        predicted = 0.0 if launch.kind in WARNED else (interval / 2 if interval else None)
        rows.append({"launch": launch.index, "kind": launch.kind, "at_step": launch.reached,
                     "resumed_from": after.resumed_from, "steps_lost": lost,
                     "seconds_lost": round(lost * step_s, 3) if step_s else None,
                     "predicted_s": None if predicted is None else round(predicted, 3),
                     "restart_s": round(restart, 3)})
    return rows


def _step_seconds(launches: list[Launch]) -> float | None:
    """Median seconds per step between consecutive progress events."""
    rates = []
    for launch in launches:
        marks = launch.of("progress")
        rates += [(b["t"] - a["t"]) / (b["step"] - a["step"])
                  for a, b in zip(marks, marks[1:]) if b["step"] > a["step"]]
    return statistics.median(rates) if rates else None
