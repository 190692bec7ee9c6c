"""What ``spotguard drill`` concludes from the run records of its launches.

Everything here reads only what the library appended to ``$SPOTGUARD_RECORD``
(:mod:`spotguard._record`), never what the job prints: a job cannot pass by printing the right line.
:func:`judge` turns the launches of one drill (and the reference run, when there was one) into
:class:`Check` results, each with a diagnosis written for the person who owns the job, and
:func:`losses` into the cost of each preemption, set against the Young/Daly prediction for the
save cost the records measured.

A preemption counts only when it took effect (:func:`ineffective`): the record shows the job's
stop after it, or the drill's SIGKILL landed, and the next launch resumed from a committed step
after 0. The verdict rests on what took effect: PASSED once every kind did at least once (or all
those asked did); else INCONCLUSIVE (:func:`verdict`), never PASSED, with the argument that makes
commits come earlier named. A check that would pass on nothing (resumes when no relaunch resumed,
saves on warning when no warned preemption took effect) is shown as not judged, never as passed.
A notice that could not reach the job because it does not listen to the daemon (its record says
``Run(daemon=False)``) is named as the cause, not the loop.

A job that is not reproducible run to run (:func:`reproducible`: the reference and the first
launch, not yet preempted, committed different states at the same step) cannot be judged by
equal final digests. It is judged by what stays exact even then (each relaunch loaded the state
that was committed, consumed the reference's samples at every step; its step, epoch, LR and RNG
streams went on: :mod:`~spotguard_daemon.commands.drill_marks`) and by its final parameters' and
last loss's distances from the reference's, against the spread of two uninterrupted references
(``spread``, measured by the drill).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard._run_parts import SAVE_EVERY_ENV
from spotguard.cadence import DEFAULT_NODE_MTBF_S, expected_waste, young_interval
from spotguard_daemon.commands.drill_diff import describe
from spotguard_daemon.commands.drill_marks import progress_checks

__all__ = ["Check", "Launch", "judge", "verdict", "ineffective", "reproducible", "losses",
           "save_figures", "step_seconds", "KINDS", "SPREAD_FACTOR", "DETERMINISM"]

KINDS = ("notice", "short-notice", "sigterm", "sigkill")
"""The drill's kinds of preemption."""
RESUMING = ("resume", "loads", "step", "rng streams", "epoch", "lr", "data", "identical")
"""Checks about resuming: they rest on nothing until a relaunch resumed from a committed step."""
WARNED = ("notice", "sigterm")
"""Preemption kinds that leave room to save: they must lose no step."""
SPREAD_FACTOR = 10.0
"""A nondeterministic job's drilled final parameters may lie this many times the distance between
two uninterrupted references from the first reference (with a floor of 1e-6): its noise compounds
from a random step on, as a second reference's does."""
DETERMINISM = ("torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8 and "
               "torch.backends.cudnn.benchmark = False (and no unseeded generator)")


@dataclass
class Launch:
    """One run of the user's command: what the drill did to it and what the library recorded."""

    index: int
    kind: str | None = None
    label: str | None = None
    """Its name in the log, for the reference runs (``reference``, ``reference-2``)."""
    """The preemption planned for it (notice, short-notice, sigterm, sigkill), None for none."""
    target: int | None = None
    log: Path | None = None
    t_launch: float = 0.0
    t_end: float = 0.0
    status: int | None = None
    preempted_at: float | None = None
    preempted_step: int | None = None
    """The step the record showed when the preemption was delivered (the log, table and picture
    all use this one)."""
    deadline: float | None = None
    """Seconds from the preemption to the drill's kill (0 for sigkill)."""
    skipped: str | None = None
    """Why its planned preemption was not delivered, if it was not."""
    killed: bool = False
    ranks: int | None = None
    """The ranks the drill launched it on, when it changes them (``--resize``)."""
    pid: int | None = None
    pids: set[int] = field(default_factory=set)
    """The launch's descendants the drill saw, by verified identity."""
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

    @property
    def landed(self) -> bool:
        """The preemption stopped the job: its record shows the stop after it, or the drill's
        SIGKILL ended it, before it finished."""
        if not self.preempted or self.first("finish") is not None:
            return False
        stopped = any(e["t"] >= self.preempted_at - 0.05 for e in self.of("stop"))
        return stopped or (self.killed and self.status in (-9, 137))

    def point(self) -> dict[str, Any]:
        """The launch for the JSON report, without its raw events."""
        return {"launch": self.index, "ranks": self.ranks, "preemption": self.kind if self.preempted else None,
                "target_step": self.target, "preempted_at_step": self.preempted_step,
                "status": self.status, "killed": self.killed,
                "resumed_from": self.first("start") and self.first("start").get("resumed_from"),
                "reached": self.reached, "seconds": round(self.t_end - self.t_launch, 3),
                "log": str(self.log) if self.log else None}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    inconclusive: bool = False
    """A failure of this check leaves the verdict INCONCLUSIVE, not FAILED: the drill could not
    prove enough, the job did nothing wrong."""
    judged: bool = True
    """False for a check that found nothing wrong but rests on nothing (no relaunch resumed, no
    warned preemption took effect): shown as not judged, never as passed."""


def verdict(checks: list[Check]) -> str:
    """PASSED, FAILED (a check found a fault) or INCONCLUSIVE (nothing failed, but too little
    was proven)."""
    if any(not c.ok and not c.inconclusive for c in checks):
        return "FAILED"
    return "INCONCLUSIVE" if any(not c.ok for c in checks) else "PASSED"


def judge(launches: list[Launch], reference: Launch | None, asked: int | None = None,
          spread: dict[str, Any] | None = None, layout: dict[str, Any] | None = None, *,
          save_every: int | None = None, differing: tuple[list, bool] | None = None) -> list[Check]:
    """The drill's verdict, check by check; a failed check's ``detail`` says what to fix.
    ``asked``: the preemptions planned (default: those delivered); ``spread``: the distances the
    drill measured for a nondeterministic job (see :func:`reproducible`); ``layout``: the
    ``ddp_layout`` entry of the job's last checkpoint, when it has one; ``save_every``: the steps
    between saves the drill gave the launches (``$SPOTGUARD_SAVE_EVERY``), for the advice;
    ``differing``: where the final states differ, from :func:`.drill_diff.differences`."""
    checks = [_started(launches), _fresh(launches[0]), _resumes(launches), _loads(launches),
              _warned(launches), _finished(launches[-1]), _data(launches, reference)]
    checks += [Check(*found) for found in progress_checks(launches, reference)]
    checks.append(_took_effect(launches, asked, save_every))
    if reference is not None:
        same, step = reproducible(launches, reference)
        checks.append(_identical(launches, reference, layout, differing) if same is not False
                      else _within_spread(launches, step, spread, layout))
    return _unjudged(launches, [check for check in checks if check is not None])


def _unjudged(launches: list[Launch], checks: list[Check]) -> list[Check]:
    """Mark the passing checks that rest on nothing as not judged (see :attr:`Check.judged`)."""
    resumed = any(launch.started and launch.resumed_from > 0 for launch in launches[1:])
    warned = any(launch.kind in WARNED and ineffective(launch, after) is None
                 for launch, after in zip(launches, launches[1:]) if launch.preempted)
    for check in checks:
        if not check.ok:
            continue
        if check.name in RESUMING and not resumed:
            check.judged, check.detail = False, "not judged: no relaunch resumed from a checkpoint"
        elif check.name == "saves on warning" and not warned:
            check.judged, check.detail = False, ("not judged: no warned preemption (notice, "
                                                 "sigterm) took effect")
    return checks


def _deaf(launch: Launch) -> bool:
    """The launch does not listen to the daemon: its record's start says so (Run(daemon=False))."""
    return (launch.first("start") or {}).get("daemon") is False


DEAF = ("the job does not listen to the daemon (its record says Run(daemon=False)), so the "
        "notice never reached it")

def ineffective(launch: Launch, after: Launch | None) -> str | None:
    """Why a delivered preemption did not take effect, or None when it did (see the module
    docstring)."""
    if not launch.landed:
        if launch.kind in ("notice", "short-notice") and _deaf(launch):
            return DEAF
        if launch.first("finish") is not None:
            return f"the job finished at step {launch.reached} before it stopped"
        return f"the job exited with status {launch.status} on its own, not stopped by it"
    if after is None or not after.started:
        return "no later launch resumed"
    if after.resumed_from <= 0:
        return "the next launch resumed from step 0 (nothing was committed before it)"
    return None


def _took_effect(launches: list[Launch], asked: int | None, save_every: int | None = None) -> Check:
    """Passes once every kind took effect at least once, or every preemption planned did."""
    preempted = [launch for launch in launches if launch.preempted]
    asked = len(preempted) if asked is None else asked
    why = [(launch, ineffective(launch, after)) for launch, after in
           zip(launches, [*launches[1:], None]) if launch.preempted]
    done = sum(reason is None for _, reason in why)
    kinds = {launch.kind for launch, reason in why if reason is None}
    detail = (f"{done} of {asked} preemption(s) took effect (the record shows the stop or the kill "
              "landed, and a later launch resumed from a committed step after 0)")
    misses = [f"launch {launch.index}'s {launch.kind} at step {launch.preempted_step}: {reason}"
              for launch, reason in why if reason]
    misses += [f"launch {launch.index}: {launch.skipped}" for launch in launches if launch.skipped]
    if (done >= asked or set(KINDS) <= kinds) and done > 0:
        every = ", every kind at least once" if set(KINDS) <= kinds else ""
        return Check("preemptions", True, detail + every + ("; not landed: " + "; ".join(misses)
                                                            if misses else ""))
    if len(preempted) < asked:
        misses.append(f"{asked - len(preempted)} never delivered: the job ended, or committed no "
                      "step to resume from, before their turn")
    missing = [kind for kind in KINDS if kind not in kinds]
    return Check("preemptions", False, detail + f" (none of kind {', '.join(missing)}); "
                 + "; ".join(misses) + ". " + _sooner(launches, save_every), inconclusive=True)


def _sooner(launches: list[Launch], save_every: int | None) -> str:
    """What makes commits come early enough, from where the job's cadence came (its record)."""
    source = (launches[-1].first("start") or {}).get("cadence")
    steps = save_every or "N"
    if source in ("save_every", "cadence"):
        how = (f"the job sets its own cadence (Run(save_every=...) or cadence=), which wins over "
               f"the drill's ${SAVE_EVERY_ENV}: for the drill pass save_every={steps}")
    elif source == "save_steps":
        how = (f"the HF Trainer saves every TrainingArguments(save_steps=...): for the drill pass "
               f"save_steps={steps}")
    elif source == "env":
        how = f"the drill gave the job ${SAVE_EVERY_ENV}={steps} and it was not enough"
    else:
        how = f"save sooner: Run(save_every={steps})"
    return (f"Make the job run longer (more steps), or make its first commit come earlier ({how}),"
            " or ask for fewer preemptions (-n)")

def reproducible(launches: list[Launch], reference: Launch) -> tuple[bool | None, int | None]:
    """Whether the job is reproducible run to run: the reference and the first launch (the same
    command, fresh, not yet preempted when it committed) hold equal states at every step both
    committed. (False, the first step that differs); (True, None); (None, None) without a step
    in common."""
    theirs = {c["step"]: c.get("digest") for c in reference.of("commit")}
    mine = {c["step"]: c.get("digest") for c in launches[0].of("commit")}
    common = sorted(set(theirs) & set(mine))
    differ = [step for step in common if theirs[step] != mine[step]]
    if differ:
        return False, differ[0]
    return (True, None) if common else (None, None)


def _within_spread(launches: list[Launch], step: int | None, spread: dict[str, Any] | None,
                   layout: dict[str, Any] | None) -> Check:
    source = (f"the job is not reproducible run to run: the reference and launch 1 (not yet "
              f"preempted) committed different states at step {step}. The likely source: "
              "nondeterministic kernels (atomics-based reductions, cuDNN autotuning) or an "
              f"unseeded generator; {DETERMINISM} make it reproducible, and the drill exact. ")
    if not spread or spread.get("drill") is None or spread.get("reference") is None:
        return Check("identical", False, source + "The final states could not be compared "
                     f"({(spread or {}).get('why', 'no second reference')})", inconclusive=True)
    loss = spread.get("loss") or {}
    within = spread["drill"] <= spread["threshold"] and (
        loss.get("drill") is None or loss["drill"] <= loss["threshold"])
    figures = (f"the drilled final parameters lie {spread['drill']:.3g} (relative) from the "
               f"reference's, two uninterrupted references {spread['reference']:.3g} apart: "
               f"threshold {spread['threshold']:.3g} ({SPREAD_FACTOR:g} x their spread)")
    if loss.get("drill") is not None:
        figures += (f"; the final loss lies {loss['drill']:.3g} (relative) from the reference's, "
                    f"the second reference's {loss['reference']:.3g}: threshold {loss['threshold']:.3g}")
    else:
        figures += f"; the final loss is not compared ({loss.get('why', 'not recorded')})"
    if within:
        return Check("identical", True, source + "Judged by what stays exact (loads, data, steps) "
                     "and " + figures)
    return Check("identical", False, source + "Even so the resume changed the result: " + figures
                 + ". " + _cause(launches, layout))


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
    for launch in launches:
        for event in launch.of("restore_failed"):
            return Check("resume", False, f"launch {launch.index} did not restore the newer "
                         f"checkpoint the durable store held (step {event.get('store_step')}) and "
                         f"went on from local step {event.get('local_step')}: {event.get('error')}")
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
    committed: dict[int, str] = {}
    for launch in launches:
        start = launch.first("start") or {}
        loaded = start.get("loaded_digest")
        if loaded and committed.get(launch.resumed_from, loaded) != loaded:
            return Check("loads", False, f"launch {launch.index} loaded a state of step "
                         f"{launch.resumed_from} other than the one committed at that step (digest "
                         f"{loaded[:16]}, committed {committed[launch.resumed_from][:16]}): another "
                         "checkpoint was put in its place (a store restore, another job's files)")
        committed.update((c["step"], c.get("digest")) for c in launch.of("commit") if c.get("digest"))
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
            cause = (f"{DEAF}: the drill killed it at the deadline. A job that must hear daemon "
                     "notices keeps Run's default daemon=True" if launch.kind == "notice"
                     and _deaf(launch) else "the job did not save before exiting (is "
                     "spotguard.Run's loop reached promptly, and does the job let it handle "
                     "SIGTERM?)")
            return Check("saves on warning", False, f"launch {launch.index} lost {lost} step(s) to "
                         f"{how}: {cause}")
    return Check("saves on warning", True, "warned preemptions lost no step")


def _finished(last: Launch) -> Check:
    """The job's finish, from the last launch. One that the drill sent SIGTERM to and that recorded
    its finish all the same (a deadline far enough to train the last steps) finished: its launcher's
    status is the signal's (torchrun's agent exits 1 of it), not the job's."""
    finish = last.first("finish")
    if finish is not None and last.status == 0:
        return Check("finished", True, f"the job finished at step {finish['step']}")
    if finish is not None and last.preempted and last.kind == "sigterm":
        return Check("finished", True, f"the job finished at step {finish['step']} (after the drill's "
                     f"SIGTERM; the launch exited with status {last.status})")
    return Check("finished", False, f"the last launch exited with status {last.status} without "
                 f"finishing; see {last.log}")


def _identical(launches: list[Launch], reference: Launch, layout: dict[str, Any] | None,
               differing: tuple[list, bool] | None = None) -> Check:
    last = launches[-1]
    mine, theirs = last.first("finish"), reference.first("finish")
    if theirs is None:
        return Check("identical", False, "the uninterrupted reference run did not finish; "
                     f"see {reference.log}")
    if mine is None or mine.get("digest") == theirs.get("digest"):
        return Check("identical", mine is not None, "final state bit-identical to the "
                     f"uninterrupted run (digest {theirs.get('digest', '')[:16]})" if mine else
                     "no final state to compare")
    found, renamed = differing or (None, False)
    if found == [] and renamed:
        return Check("identical", True, "final state bit-identical to the uninterrupted run's but "
                     "for the names of Lightning's checkpoint files: its ModelCheckpoint wrote "
                     "'…-v1.ckpt' where the name it wanted existed already (the reference run wrote "
                     "it, in the same directory, or a launch killed after writing it). The weights, "
                     "optimizer, scores and counters are identical")
    where = f" It differs in: {describe(found)}." if found else ""
    if any(path.endswith("/dirpath") and "ModelCheckpoint" in path for path, _, _ in found or ()):
        where += (" Lightning's logger made a new version directory at the relaunch, so its "
                  "ModelCheckpoint wrote elsewhere and did not reload the scores it tracks: give the "
                  "logger a fixed version (CSVLogger(save_dir, version=0)) or the ModelCheckpoint "
                  "a dirpath.")
    return Check("identical", False, "the final training state differs from the uninterrupted "
                 "run's. " + _cause(launches, layout) + _diverged(launches, reference) + where)


def _cause(launches: list[Launch], layout: dict[str, Any] | None) -> str:
    """What most likely makes a resumed run differ: a stateful object the job uses but did not
    hand to spotguard.Run (the library records it), else the arithmetic of the first resumed step
    (DDP's buckets, autocast, nondeterministic kernels): the state and data were restored."""
    unsaved = sorted({e["what"] for launch in launches for e in launch.events
                      if e["event"] == "unsaved" and isinstance(e.get("what"), str)})
    entries = (launches[-1].first("start") or {}).get("entries")
    holds = f" Its checkpoint holds: {', '.join(map(str, entries))}." if entries else ""
    if unsaved:
        return (f"The job uses state that is not in its checkpoint: {'; '.join(unsaved)}. Pass it "
                "to spotguard.Run (optimizer=, scheduler=, loader=, or state={...})." + holds)
    ddp = next((e for launch in launches for e in launch.of("ddp")), None)
    if ddp is not None and (ddp.get("world_size") or 0) >= 3:
        return (f"Everything the job handed to spotguard.Run is in its checkpoint, but its "
                f"{ddp.get('entry')} trains through a DistributedDataParallel that Run was not given "
                "(it got the module inside): DDP's gradient bucket layout is neither recorded nor "
                "restored, so after a resume DDP all-reduces in other buckets and, with "
                f"{ddp.get('world_size')} ranks, sums each gradient in another order. The "
                "arithmetic of the resumed steps differs (DDP bucket layout, reduction order), not "
                f"the state: pass the DDP itself to spotguard.Run ({ddp.get('entry')}=ddp)." + holds)
    if isinstance(layout, dict) and layout.get("restorable") is False:
        return ("Everything the job uses is in its checkpoint, but DDP's gradient bucket layout "
                f"cannot be restored ({layout.get('why')}): the first step after a resume "
                "all-reduces other buckets, so its arithmetic differs." + holds)
    if isinstance(entries, list) and "lightning" in entries:
        return ("The Lightning callback restores Lightning's checkpoint dict, the data position and "
                "the RNG streams; what differs is named below. Known causes: a stop with no room to "
                "wait, or on several ranks, right after an epoch's last batch when no validation "
                "follows it (Lightning does not run that epoch's end again on resume, so an epoch "
                "scheduler's step or an epoch-end hook's work is missing: docs/library/"
                "frameworks.md); state the module keeps outside that dict (an attribute changed in "
                "training_step that on_save_checkpoint does not save)." + holds)
    if not any(e["event"] == "data" for launch in launches for e in launch.events):
        return ("Something the job depends on is not in its checkpoint: the data position and "
                "its seeds are not recorded (a torch DataLoader shuffles from the global RNG and "
                "restarts its epoch; use spotguard.DataLoader and pass it as loader=), or the "
                "optimizer, the scheduler or an RNG; pass every stateful object to spotguard.Run."
                + holds)
    return ("The job's state and data were restored exactly (every stateful object it uses is "
            "in the checkpoint; loaded digests and samples match), so the arithmetic of the "
            "resumed steps differs: DDP's gradient buckets, autocast, or nondeterministic "
            f"kernels ({DETERMINISM})." + holds)


def _data(launches: list[Launch], reference: Launch | None) -> Check | None:
    """Each launch consumed, at every step it recorded, the samples the reference consumed at that
    step (digests of sample ids, recorded by spotguard.DataLoader / ResumableSampler)."""
    if reference is None:
        return None
    theirs = {e["step"]: e["ids"] for e in reference.of("data")}
    if not theirs:
        return None
    for launch in launches:
        for event in launch.of("data"):
            if theirs.get(event["step"], event["ids"]) != event["ids"]:
                after = (f" after it resumed from step {launch.resumed_from}"
                         if launch.resumed_from else "")
                return Check("data", False, f"launch {launch.index} consumed other samples at step "
                             f"{event['step']}{after} than the uninterrupted run: its data "
                             "position or order is not restored (a loader shuffling from the "
                             "global RNG, or one not passed to spotguard.Run as loader=)")
    return Check("data", True, "every step consumed the samples the uninterrupted run did")


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
    between consecutive periodic commits of one launch), and Young's optimum for C at the MTBF the
    job planned with (its last commit's: given, learned by the daemon, or the default)."""
    commits = [c for launch in launches for c in launch.of("commit")]
    costs = [c.get("blocking_s", 0) + c.get("persist_s", 0) for c in commits]
    gaps = [b["t"] - a["t"] for launch in launches
            for a, b in zip(launch.of("commit"), launch.of("commit")[1:]) if b.get("kind") == "periodic"]
    cost = statistics.median(costs) if costs else None
    interval = statistics.median(gaps) if gaps else None
    planned = [(c["mtbf_s"], c.get("mtbf_source")) for c in commits
               if isinstance(c.get("mtbf_s"), (int, float)) and not isinstance(c["mtbf_s"], bool) and c["mtbf_s"] > 0]
    mtbf, source = planned[-1] if planned else (DEFAULT_NODE_MTBF_S, "default")
    young = young_interval(mtbf, cost) if cost else None
    waste = expected_waste(interval, mtbf, cost) if cost and interval else None
    return {"save_cost_s": cost, "save_interval_s": interval, "young_interval_s": young,
            "mtbf_s": mtbf, "mtbf_source": source, "expected_waste": waste}


def losses(launches: list[Launch], figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Steps and seconds each preemption cost, against the prediction: an unwarned preemption at a
    uniformly random instant loses half a save interval (Young/Daly's rework term), a warned one
    nothing; plus the restart (kill to the relaunch's start)."""
    step_s = step_seconds(launches)
    rows = []
    for launch, after in zip(launches, [*launches[1:], None]):
        if not launch.preempted:
            continue
        resumed = after.resumed_from if after is not None and after.started else None
        lost = None if resumed is None else max(0, launch.reached - resumed)
        start = after.first("start") if after is not None else None
        restart = None if start is None else start["t"] - launch.preempted_at
        interval = figures.get("save_interval_s")
        predicted = 0.0 if launch.kind in WARNED else (interval / 2 if interval else None)
        rows.append({"launch": launch.index, "kind": launch.kind, "at_step": launch.preempted_step,
                     "stopped_at": launch.reached, "effective": ineffective(launch, after) is None,
                     "resumed_from": resumed, "steps_lost": lost,
                     "seconds_lost": round(lost * step_s, 3) if step_s and lost is not None else None,
                     "predicted_s": None if predicted is None else round(predicted, 3),
                     "restart_s": None if restart is None else round(restart, 3)})
    return rows


def step_seconds(launches: list[Launch]) -> float | None:
    """Median seconds per step between consecutive progress events."""
    rates = []
    for launch in launches:
        marks = launch.of("progress")
        rates += [(b["t"] - a["t"]) / (b["step"] - a["step"])
                  for a, b in zip(marks, marks[1:]) if b["step"] > a["step"]]
    return statistics.median(rates) if rates else None
