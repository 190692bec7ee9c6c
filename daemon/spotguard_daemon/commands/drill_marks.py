"""The checks ``spotguard drill`` makes from the progress marks the library records at each save and
after each load (``marks`` events, :mod:`spotguard._audit`): what stays exact across a resume even
for a job that is not reproducible run to run.

* ``rng streams``: each relaunch's global RNG streams (Python, NumPy, torch, CUDA), right after its
  load, are the ones saved at that step (by as many ranks: an elastic resume re-derives them); and every stream the job seeds (equal in the reference and
  in launch 1 before its preemption) equals the uninterrupted run's at every step both runs saved;
* ``step``: each relaunch counts on from the step it loaded;
* ``epoch`` and ``lr``: each relaunch's epoch and learning rates right after its load are the ones
  saved at that step, and equal the uninterrupted run's at every step both runs saved.

A check the records give nothing for (no marks: an older library, a framework that records none)
is left out. Each failure names the step, the launch that resumed before it and the likely part.
The launches are :class:`~spotguard_daemon.commands.drill_checks.Launch` objects (which module
imports this one); a check comes back as :class:`Found`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

__all__ = ["Found", "progress_checks"]


class Found(NamedTuple):
    """One check's outcome: :class:`~spotguard_daemon.commands.drill_checks.Check`'s fields."""

    name: str
    ok: bool
    detail: str


def _marks(launch: Any, at: str) -> dict[int, dict[str, Any]]:
    return {event["step"]: event for event in launch.of("marks") if event.get("at") == at}


def _world(launch: Any) -> int | None:
    return (launch.first("start") or {}).get("world_size")


def _saved_before(launches: list[Any], launch: Any, step: int, same_world: bool = False) -> dict[str, Any] | None:
    """The marks saved at ``step`` by the newest launch before ``launch`` that saved it (None when
    ``same_world`` and that launch ran on another number of ranks)."""
    for earlier in reversed(launches[: launches.index(launch)]):
        found = _marks(earlier, "save").get(step)
        if found is not None:
            return None if same_world and _world(earlier) != _world(launch) else found
    return None


def _at_load(launches: list[Any], field: Callable[[dict[str, Any]], Any], same_world: bool = False):
    """(launch, step, loaded value, saved value) of the first relaunch whose value right after its
    load differs from the one saved at that step (``same_world``: by as many ranks); None when none
    does."""
    for launch in launches[1:]:
        for step, loaded in _marks(launch, "load").items():
            saved = _saved_before(launches, launch, step, same_world)
            if saved is not None and field(loaded) is not None and field(saved) is not None \
                    and field(loaded) != field(saved):
                return launch, step, field(loaded), field(saved)
    return None


def _against(launches: list[Any], reference: Any | None, field: Callable[[dict[str, Any]], Any]):
    """(step, drilled value, reference value, last equal step, the relaunch between them) at the
    first step both saved where the drilled value differs from the reference's; None when none."""
    if reference is None:
        return None
    theirs = _marks(reference, "save")
    mine = sorted((step, launch.index, event) for launch in launches
                  for step, event in _marks(launch, "save").items() if step in theirs)
    equal = 0
    for step, _, event in mine:
        a, b = field(event), field(theirs[step])
        if a is None or b is None:
            continue
        if a != b:
            culprit = next((launch for launch in launches[1:] if equal <= launch.resumed_from < step), None)
            return step, a, b, equal, culprit
        equal = step
    return None


def _where(equal: int, culprit: Any | None) -> str:
    after = f", after launch {culprit.index} resumed from step {culprit.resumed_from}" if culprit else ""
    return f"(equal at step {equal}{after})"


def _seeded(launches: list[Any], reference: Any | None) -> set[str]:
    """The RNG streams the job seeds: equal in the reference and launch 1 at their first common
    save (an unseeded stream, such as Python's ``random`` in a job that never seeds it, starts from
    OS entropy in every process and is compared only with itself across a load)."""
    if reference is None:
        return set()
    theirs, mine = _marks(reference, "save"), _marks(launches[0], "save")
    common = sorted(set(theirs) & set(mine))
    if not common:
        return set()
    a, b = theirs[common[0]].get("rng") or {}, mine[common[0]].get("rng") or {}
    return {name for name in a if a[name] == b.get(name)}


def _rng(launches: list[Any], reference: Any | None) -> Found | None:
    if not any(launch.of("marks") for launch in launches):
        return None
    streams = sorted({name for launch in launches for event in launch.of("marks") for name in event.get("rng") or {}})
    for name in streams:
        found = _at_load(launches, lambda event: (event.get("rng") or {}).get(name), same_world=True)
        if found:
            launch, step, loaded, saved = found
            return Found("rng streams", False, f"launch {launch.index}'s {name} RNG stream right "
                         f"after loading step {step} is not the one saved at step {step} (digest "
                         f"{loaded}, saved {saved}): the checkpoint's RNG state was not restored into "
                         "it (is the rng entry in the checkpoint, and does the job reseed after the load?)")
    for name in sorted(_seeded(launches, reference)):
        found = _against(launches, reference, lambda event: (event.get("rng") or {}).get(name))
        if found:
            step, _, _, equal, culprit = found
            return Found("rng streams", False, f"the {name} RNG stream at step {step} is not the "
                         f"uninterrupted run's {_where(equal, culprit)}: after the resume something "
                         "draws from it that the uninterrupted run did not draw at that point (a torch "
                         "DataLoader drawing its iterator's seed from the global RNG: use "
                         "spotguard.DataLoader, or give the loader a generator in the checkpoint; a "
                         "reseed in the loop)")
    resized = any(_world(a) != _world(b) for a, b in zip(launches, launches[1:]) if b.resumed_from)
    return Found("rng streams", True, "every RNG stream was restored at each load"
                 + (" on as many ranks (re-derived for the new ranks where the world size changed)"
                    if resized else "")
                 + (" and went on as in the uninterrupted run" if reference is not None else ""))


def _step(launches: list[Any]) -> Found | None:
    for launch in launches[1:]:
        if not launch.started or launch.resumed_from == 0:
            continue
        below = [e["step"] for e in launch.events if e["event"] in ("progress", "commit", "marks")
                 and e.get("rank", 0) == 0 and e.get("step", 0) < launch.resumed_from]
        if below:
            return Found("step", False, f"launch {launch.index} loaded step {launch.resumed_from} but "
                         f"counted from step {min(below)}: the step counter was not restored with the "
                         "checkpoint (a framework's global step, or a loop that counts on its own)")
    return Found("step", True, "every relaunch counted on from the step it loaded")


def _continues(launches: list[Any], reference: Any | None, name: str, fix: str) -> Found | None:
    """Check ``name`` (a marks field: ``epoch``, ``lr``); ``fix`` says what to do when it fails."""
    field = (lambda event: event.get(name))
    if not any(field(e) not in (None, []) for launch in launches for e in launch.of("marks")):
        return None
    found = _at_load(launches, field)
    if found:
        launch, step, loaded, saved = found
        return Found(name, False, f"launch {launch.index}'s {name} right after loading step {step} "
                     f"is {loaded}, saved {saved}: {fix}")
    found = _against(launches, reference, field)
    if found:
        step, mine, theirs, equal, culprit = found
        return Found(name, False, f"the {name} at step {step} is {mine}, the uninterrupted run's "
                     f"{theirs} {_where(equal, culprit)}: {fix}")
    return Found(name, True, f"the {name} went on across every relaunch"
                 + (" as in the uninterrupted run" if reference is not None else ""))


EPOCH_FIX = ("the data position is not restored: pass the sampler or loader to spotguard.Run "
             "(loader=) and start the epoch loop at sampler.epoch")
LR_FIX = ("the learning-rate schedule is not restored: pass both the optimizer (its param groups "
          "hold the LR) and the LR scheduler to spotguard.Run (optimizer=, scheduler=)")


def progress_checks(launches: list[Any], reference: Any | None) -> list[Found]:
    """The checks above, those the records give something for."""
    checks = [_rng(launches, reference), _step(launches),
              _continues(launches, reference, "epoch", EPOCH_FIX),
              _continues(launches, reference, "lr", LR_FIX)]
    return [check for check in checks if check is not None]
