"""When and how ``spotguard drill`` preempts its launches: the plan, a mixin of
:class:`~spotguard_daemon.commands.drill.Drill`.

From the reference's measured step time and save cost (else the first launch's so far): the steps
between saves the drilled launches are given (``$SPOTGUARD_SAVE_EVERY``, :meth:`Planning.every`),
how many preemptions fit the job's length (:meth:`Planning._fit`: every kind once as soon as four
fit), each one's target step in its slot of the steps after the first commit, early enough to land
before the job ends (:meth:`Planning._plan`), and each kind's deadline (:meth:`Planning.deadline`).
None is delivered before a step is committed (nothing to resume from).

The mixin uses the drill's ``kinds``, ``slots``, ``rng``, ``measured``, ``save_every``, ``fitted``,
``first``, ``delivered`` and ``live``.
"""

from __future__ import annotations

import math
from typing import Any

from spotguard_daemon.commands.drill_checks import KINDS, Launch, save_figures

__all__ = ["Planning", "SAVE_MARGIN_S", "SHORT_S", "SIGTERM_GRACE_S"]

SAVE_MARGIN_S = 2.0
"""``Run``'s default ``save_margin``: an emergency save is taken only when it fits this far before
the deadline."""
AGREEMENT_LAG_S = 0.5
"""How late the ranks of a multi-rank job may act on a notice (``Agreement``'s ``max_lag``)."""
SHORT_S = 1.0
"""Deadline of a notice too close to save (under the library's margin)."""
SIGTERM_GRACE_S = 30.0
"""Seconds between SIGTERM and SIGKILL: Kubernetes' default ``terminationGracePeriodSeconds``."""


class Planning:
    """The drill's plan (see the module docstring)."""

    kinds: list[str]
    slots: list[float]
    rng: Any
    measured: Launch | None
    save_every: int | None
    fitted: bool
    first: int | None
    delivered: int
    live: Any

    def every(self, launch: Launch) -> int | None:
        """Steps between saves for the drilled launches, from ``launch``'s length: about two saves
        per preemption asked, and no closer than one save's cost in steps, up to one save per
        preemption; None when its length or step time is unknown."""
        total = (launch.first("start") or {}).get("total") or launch.reached
        step_s, save_s = _mean_step_s(launch), save_figures([launch])["save_cost_s"] or 0.0
        if not total or not step_s:
            return None
        slots = len(self.kinds) + 1
        return max(1, total // (2 * slots), min(math.ceil(save_s / step_s), total // slots))

    def _rates(self, launch: Launch) -> tuple[float | None, float]:
        """Seconds per step and per save, measured on the reference (else this launch so far). The
        step time is the mean over the recorded progress, stalls included (a loader's workers
        starting, a save), the larger of the reference's and this launch's so far: a median
        would promise steps a slower relaunch does not make before its end."""
        runs = [self.measured] if self.measured is not None else [launch]
        save = save_figures(runs)["save_cost_s"] or save_figures([launch])["save_cost_s"] or 0.0
        rates = [rate for rate in (_mean_step_s(runs[0]), _mean_step_s(launch)) if rate]
        return max(rates, default=None), save

    def deadline(self, kind: str, save_s: float, step_s: float) -> float:
        """Seconds from delivery to the kill: for ``notice`` room for the job's emergency save
        (twice the measured cost), the library's margin, two steps and the ranks' agreement lag,
        so that the job stops at once and saves; for ``sigterm`` Kubernetes' default grace; ``short-notice`` less than the
        margin; ``sigkill`` 0."""
        if kind in ("short-notice", "sigkill", "sigterm"):
            return {"short-notice": SHORT_S, "sigkill": 0.0, "sigterm": SIGTERM_GRACE_S}[kind]
        return round(max(3.0, SAVE_MARGIN_S + AGREEMENT_LAG_S + 2 * save_s + 2 * step_s + 1.0), 1)

    @staticmethod
    def landing(kind: str, save_s: float, step_s: float) -> float:
        """Seconds from delivery until the preemption has surely stopped the job: the kill for
        ``short-notice`` and ``sigkill``; for ``notice`` and ``sigterm`` the job's stop at its next
        step and its save, well before the kill."""
        if kind in ("short-notice", "sigkill"):
            return SHORT_S if kind == "short-notice" else 0.0
        return 0.5 + 2 * save_s + 2 * step_s

    def _due(self, launch: Launch) -> bool:
        """Whether the launch reached its target step; never before a step after 0 is committed (a
        preemption then has nothing to resume from)."""
        start = launch.first("start")
        committed = bool(launch.of("commit")) or launch.resumed_from > 0
        if start is None or not start.get("total") or launch.skipped or not committed:
            return False
        if launch.target is None and not self._plan(launch, start["total"]):
            return False
        return launch.reached >= launch.target

    def _plan(self, launch: Launch, total: int) -> bool:
        """Choose the launch's deadline and target step: in this preemption's slot of the steps from
        just after the first commit to the last one from which it still lands before step
        ``total``. False while the step time is unknown, or when no such step is left (then
        ``launch.skipped`` says so, and it is never delivered)."""
        step_s, save_s = self._rates(launch)
        if step_s is None:
            return False
        if self.first is None:  # the drill's first commit; the reference's when its cadence is the same
            first = min([c["step"] for c in launch.of("commit")] or [launch.resumed_from])
            if self.save_every is None:
                first = min([c["step"] for c in (self.measured or launch).of("commit")] or [first])
            self.first = first
        first = self.first
        launch.deadline = self.deadline(launch.kind, save_s, step_s)
        last = self._last(launch.kind, total, save_s, step_s)
        common = min(last, *(self._last(kind, total, save_s, step_s) for kind in KINDS))
        if not self.fitted:
            self._fit(launch, max(0, common - first - 1))
        slot = self.slots.pop(0) if self.slots else 0.5
        target = max(max(first, launch.resumed_from) + 1, first + 1 + int(slot * max(0, common - first - 1)))
        if target > last:
            launch.skipped = (f"no room left for a {launch.kind} after step {target - 1} (it would "
                              f"not land before the job's end at step {total})")
            self.live.line(f"{self.live.name(launch)}: {launch.skipped}")
            return False
        launch.target = target
        return True

    def _last(self, kind: str, total: int, save_s: float, step_s: float) -> int:
        """The last step from which a preemption of ``kind`` still lands before step ``total``."""
        return total - math.ceil((self.landing(kind, save_s, step_s) + 0.5) / step_s) - 2

    def _fit(self, launch: Launch, room: int) -> None:
        """Plan only the preemptions that fit ``room`` steps (from the first commit to the last
        step from which every kind still lands), two steps apart at least: every kind in turn,
        those already delivered and the running launch's kept first, the rest shuffled, new slots
        for those to come. Said in one line when it trims."""
        self.fitted = True
        fit, asked, done = max(1, room // 2), len(self.kinds), self.delivered
        if fit >= asked:
            return
        kept = self.kinds[:done + 1]
        rest = [KINDS[i % len(KINDS)] for i in range(fit)]
        for kind in kept:
            if kind in rest:
                rest.remove(kind)
        self.rng.shuffle(rest)
        self.kinds = (kept + rest)[:max(fit, done + 1)]
        self.slots = [(i + self.rng.uniform(0.2, 0.8)) / fit for i in range(done, fit)]
        self.live.line(f"the job's {room} steps after its first commit leave room for {fit} of "
                       f"the {asked} preemptions asked: {', '.join(self.kinds)}")


def _mean_step_s(launch: Launch) -> float | None:
    """Seconds per step between the launch's first and last progress events (None before two)."""
    marks = launch.of("progress")
    if len(marks) < 2 or marks[-1]["step"] <= marks[0]["step"]:
        return None
    return (marks[-1]["t"] - marks[0]["t"]) / (marks[-1]["step"] - marks[0]["step"])
