"""``spotguard drill --resize N``: relaunch a ``torchrun`` job on another number of ranks, and judge
what an elastic resume promises.

A run resumed on another world size cannot end bit-identical to any uninterrupted run (each step
averages other ranks' gradients over other batches), so the drill checks what is promised instead,
from the records the library writes with ``SPOTGUARD_RECORD_ELASTIC=1`` (:mod:`spotguard._audit`):

* ``loaded state``: every rank of each relaunch, right after its load, holds the model and
  optimizer that rank 0 saved at that step (a digest per entry of every tensor of its
  ``state_dict``; DDP's replicated state whole);
* ``samples``: each pass over an epoch is one run of places of the epoch's order from its start,
  each place drawn once and no sample twice (beyond DistributedSampler's padding), and every pass
  but the last was drawn to its end: no sample of the epoch skipped or seen twice, whatever the
  ranks. Each launch counts up to the step the next one resumed from (the steps after it were lost
  and done again);
* ``loss``: the mean loss of the first :data:`LOSS_STEPS` steps after each resume rises above the
  mean of the :data:`LOSS_STEPS` before it by no more than :data:`LOSS_SIGMAS` standard deviations
  of those (about their trend) plus :data:`LOSS_LEVEL` of their mean (rank 0's loss, the last
  scalar the job called ``backward()`` on).

The relaunched command is the user's with torchrun's ``--nproc-per-node`` changed
(:func:`with_nproc`): ``N`` at the first relaunch, the command's own at the next, and so on.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterator

from spotguard_daemon.commands.drill_checks import Check, Launch

__all__ = ["NPROC", "nproc", "with_nproc", "resize_checks", "PROMISE", "LOSS_STEPS", "LOSS_SIGMAS",
           "LOSS_LEVEL"]

NPROC = ("--nproc-per-node", "--nproc_per_node")
LOSS_STEPS = 10
LOSS_SIGMAS = 3.0
LOSS_LEVEL = 0.1
PROMISE = ("not bit-identical across world sizes (a step averages other ranks' gradients over other "
           "batches): judged by the state each relaunch loaded, the sample sequence and the loss curve")


def _find(argv: list[str]) -> tuple[int, str] | None:
    """(index, value) of the first ``--nproc-per-node`` in ``argv`` (``=``-joined or not)."""
    for i, arg in enumerate(argv):
        for name in NPROC:
            if arg == name and i + 1 < len(argv):
                return i + 1, argv[i + 1]
            if arg.startswith(name + "="):
                return i, arg.split("=", 1)[1]
    return None


def nproc(argv: list[str]) -> int:
    """The number of ranks a torchrun command starts; ValueError, saying why, when it names none."""
    found = _find(argv)
    if found is None or not found[1].isdigit() or int(found[1]) < 1:
        raise ValueError("--resize relaunches a torchrun command with another --nproc-per-node: the "
                         "command names no --nproc-per-node with a number of ranks"
                         + (f" (it has {found[1]!r})" if found else ""))
    return int(found[1])


def with_nproc(argv: list[str], ranks: int) -> list[str]:
    """``argv`` with its ``--nproc-per-node`` set to ``ranks``."""
    i, _ = _find(argv)
    out = list(argv)
    out[i] = f"{out[i].split('=', 1)[0]}={ranks}" if "=" in out[i] else str(ranks)
    return out


def world(launch: Launch) -> int | None:
    return (launch.first("start") or {}).get("world_size")


def _name(launch: Launch) -> str:
    return f"launch {launch.index} ({world(launch)} ranks)"


def _kept(launches: list[Launch]) -> Iterator[tuple[Launch, int, float]]:
    """Each started launch with the steps that count: after the one it resumed from, up to the one
    the next launch resumed from."""
    for launch, after in zip(launches, [*launches[1:], None]):
        if launch.started:
            end = after.resumed_from if after is not None and after.started else math.inf
            yield launch, launch.resumed_from, end


def _loaded_state(launches: list[Launch]) -> Check:
    saved: dict[int, tuple[Launch, dict]] = {}
    compared: list[tuple] = []
    for launch in launches:
        loads = [e for e in launch.events if e["event"] == "marks" and e.get("at") == "load"
                 and isinstance(e.get("state"), dict)]
        for event in loads:
            earlier = saved.get(event["step"])
            if earlier is None:
                continue
            by, theirs = earlier
            for entry in sorted(set(theirs) & set(event["state"])):
                if event["state"][entry] != theirs[entry]:
                    return Check("loaded state", False, f"{_name(launch)}: rank {event.get('rank')}'s "
                                 f"{entry} right after loading step {event['step']} is not the one "
                                 f"{_name(by)} saved at that step (digest {event['state'][entry]}, saved "
                                 f"{theirs[entry]}): the saved state was not loaded into the job (is "
                                 f"{entry} built, or its weights loaded, after Run's load?)")
            compared.append((_name(launch), event["step"], ", ".join(sorted(theirs)), event.get("rank")))
        saved.update((e["step"], (launch, e["state"])) for e in launch.of("marks")
                     if e.get("at") == "save" and isinstance(e.get("state"), dict) and e["state"])
    if not compared:
        return Check("loaded state", False, "no relaunch recorded a digest of the state it loaded "
                     "against one saved (a sharded FSDP/DTensor state, a framework's own loop, or "
                     "a relaunch that loaded nothing)", inconclusive=True)
    ranks: dict[tuple, list] = {}
    for name, step, entries, rank in compared:
        ranks.setdefault((name, step, entries), []).append(rank)
    return Check("loaded state", True, "every rank of every relaunch loaded the state saved at that "
                 "step (digests of every tensor): " + "; ".join(
                     f"{name}: ranks {', '.join(map(str, sorted(r)))} loaded step {step}'s {entries}"
                     for (name, step, entries), r in ranks.items()))


def _passes(launches: list[Launch]) -> tuple[dict, int | None]:
    """{(epoch, pass): {place: [(sample, launch, step), ...]}} over the steps that count, and the
    dataset's length."""
    passes: dict[tuple[int, int], dict[int, list]] = {}
    size = None
    for launch, low, high in _kept(launches):
        for event in launch.events:
            if event["event"] != "samples" or not low < event["step"] <= high:
                continue
            size = event.get("of") if isinstance(event.get("of"), int) else size
            for chunk in event.get("drawn") or []:
                if not (isinstance(chunk, list) and len(chunk) == 5 and all(type(x) is int and x >= 0
                                                                            for x in chunk[:4])
                        and chunk[3] >= 1 and isinstance(chunk[4], list)):
                    continue  # not the library's: left out, as a malformed record line is
                epoch, number, first, stride, ids = chunk
                places = passes.setdefault((epoch, number), {})
                for j, sample in enumerate(ids):
                    if type(sample) is int:
                        places.setdefault(first + j * stride, []).append((sample, launch, event["step"]))
    return passes, size


def _samples(launches: list[Launch]) -> Check:
    passes, size = _passes(launches)
    if not passes or size is None:
        return Check("samples", False, "the job recorded no sample ids: its data does not come "
                     "through a spotguard.DataLoader or ResumableSampler handed to Run (loader=), so "
                     "its position is not re-split over the new ranks, and the drill cannot show that "
                     "the sample sequence continues", inconclusive=True)
    order = sorted(passes, key=lambda key: min((d[0][1].index, d[0][2]) for d in passes[key].values()))
    spans = []
    for key, after in zip(order, order[1:]):
        if after[0] < key[0]:
            by = min((d[0][1] for d in passes[after].values()), key=lambda launch: launch.index)
            left = max(passes[key]) + 1
            left = f", {size - left} of its {size} samples never drawn" if left < size else ""
            return Check("samples", False, f"epoch {after[0]} (pass {after[1]}) was drawn by {_name(by)} "
                         f"after epoch {key[0]} (pass {key[1]}){left}: the data started over (does the "
                         "job restart its data, or call set_epoch with its own counter?)")
    for key in order:
        places = passes[key]
        where = f"epoch {key[0]} (pass {key[1]})"
        twice = sorted(p for p, draws in places.items() if len(draws) > 1)
        if twice:
            (sample, a, s), (_, b, t) = places[twice[0]][:2]
            return Check("samples", False, f"{where}: {len(twice)} place(s) of its order drawn twice, "
                         f"the first sample {sample}, by {_name(a)} at step {s} and by {_name(b)} at "
                         f"step {t}: the relaunch did not go on from the saved data position")
        keys = sorted(places)
        missing = keys[-1] + 1 - len(keys)
        gap = next(i for i, place in enumerate(keys) if place != i) if missing else None
        seen: dict[Any, int] = {}
        for place in sorted(p for p in places if p < size):
            sample = places[place][0][0]
            if sample in seen:
                return Check("samples", False, f"{where}: sample {sample} drawn at places {seen[sample]} "
                             f"and {place} of the epoch: the epoch's order changed across a relaunch")
            seen[sample] = place
        last = places[max(places)][0][1]
        if missing or (key != order[-1] and keys[-1] + 1 < size - (world(last) or 1) + 1):
            skipped = (f"{missing} place(s) from place {gap}" if missing
                       else f"places {keys[-1] + 1}-{size - 1}")
            after = order[order.index(key) + 1] if key != order[-1] else None
            then = (f"; the next drawn was epoch {after[0]} (pass {after[1]}), by "
                    f"{_name(min((d[0][1] for d in passes[after].values()), key=lambda la: la.index))}"
                    if after else "")
            return Check("samples", False, f"{where}: {skipped} of its order were never drawn "
                         f"({missing or size - keys[-1] - 1} sample(s) of {size} "
                         f"skipped{then}): the relaunch did not go on with the rest of the epoch (does "
                         "the job restart its data, or call set_epoch with its own counter?)")
        drew = [launch for _, launch in sorted({d[0][1].index: d[0][1] for d in places.values()}.items())]
        if len({world(launch) for launch in drew}) > 1:
            spans.append(f"{where}: places 0-{max(places)} drawn once each by "
                         + ", ".join(_name(launch) for launch in drew))
    if not spans:
        return Check("samples", False, "no epoch was split across two world sizes (each relaunch "
                     "began an epoch): the re-split was not exercised; preempt mid-epoch (a smaller "
                     "dataset, another --seed)", inconclusive=True)
    return Check("samples", True, f"every epoch's samples drawn once, none skipped ({size} a pass); "
                 + "; ".join(spans))


def _losses(launches: list[Launch]) -> dict[int, float]:
    out = {}
    for launch, low, high in _kept(launches):
        out.update((e["step"], e["loss"]) for e in launch.of("samples")
                   if low < e["step"] <= high and isinstance(e.get("loss"), (int, float)))
    return out


def _noise(values: list[float]) -> float:
    """The standard deviation of ``values`` about their least-squares line (a falling loss's
    step-to-step noise, not its fall)."""
    xs = range(len(values))
    mx, my = statistics.fmean(xs), statistics.fmean(values)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sum((x - mx) ** 2 for x in xs)
    return statistics.pstdev([y - my - slope * (x - mx) for x, y in zip(xs, values)])


def _loss(launches: list[Launch]) -> Check:
    losses, seen = _losses(launches), []
    for launch in launches[1:]:
        step = launch.resumed_from
        if not launch.started or step <= 0:
            continue
        before = [losses[s] for s in range(step - LOSS_STEPS + 1, step + 1) if s in losses]
        after = [losses[s] for s in range(step + 1, step + LOSS_STEPS + 1) if s in losses]
        if len(before) < 3 or len(after) < 3:
            continue
        level = statistics.fmean(before)
        jump = statistics.fmean(after) - level
        tolerance = LOSS_SIGMAS * _noise(before) + LOSS_LEVEL * abs(level)
        figures = (f"{_name(launch)} resumed at step {step}: mean loss {statistics.fmean(after):.4g} over "
                   f"its first {len(after)} steps, {level:.4g} over the {len(before)} before, a rise "
                   f"of {max(jump, 0):.3g} against the tolerance {tolerance:.3g} ({LOSS_SIGMAS:g} standard "
                   f"deviations of the per-step loss before it, its trend taken out, + {LOSS_LEVEL:.0%} "
                   "of its mean)")
        if jump > tolerance:
            return Check("loss", False, figures + ": the loss curve does not continue (the model, "
                         "optimizer or learning rate does not go on from the checkpoint)")
        seen.append(figures)
    if not seen:
        return Check("loss", False, "no relaunch has 3 recorded losses on each side of its resume "
                     "(rank 0's last scalar backward(); make the job longer, or preempt later)",
                     inconclusive=True)
    return Check("loss", True, "; ".join(seen))


def resize_checks(launches: list[Launch]) -> list[Check]:
    """The checks of a drill whose relaunches change the world size (see the module docstring)."""
    return [_loaded_state(launches), _samples(launches), _loss(launches)]
