"""A notice between steps in a job of several ranks, agreed at ``run.heartbeat()``.

With ``Run(agree_at_heartbeat=True)`` every rank promises to call :meth:`Run.heartbeat` at the same
points of the work between two steps (the same evaluation loop on every rank, one call per batch).
Those calls are then agreement points, like the step boundaries: inside :meth:`Run.steps`, every
``interval`` heartbeats the ranks exchange the boundary's flags (:class:`~spotguard.distributed.
Agreement`, on its private gloo group, from the main thread: the heartbeats and boundaries of one
rank are ordered alike on every rank, so the two exchanges never interleave). The interval is a
second :class:`~spotguard.distributed.Agreement`'s, counted in heartbeats: at most 1 % of the time
between heartbeats in exchanges, and at most 2 s between two of them.

Two marks travel in the exchange: the heartbeat's number (a rank at another heartbeat, or at a
boundary, which sends 0, means the calls differ between ranks: a clear error on every rank, not a
silent mix of the two exchanges; a rank waiting elsewhere meanwhile, in DDP's all-reduce, ends at
``peer_timeout`` with 77) and the step whose end each rank's optimizer hooks captured, while
the state is still that step's (:meth:`Between.clean`; -1 otherwise). When any rank holds a
stopping notice (the far-deadline rule and ``stop_lead`` as at a boundary) and every rank is
between the same two steps, every rank saves that step, with the RNG states and loader position
captured at its end (as one process does), and stops: ``SystemExit(75)``. When they are not
(a heartbeat before the first optimizer step), the next boundary acts.

Off by default: a heartbeat on some ranks only (an evaluation on rank 0 alone) or a different
number of them (a loop bounded by time) would leave ranks waiting for each other's exchange.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from spotguard._between import as_captured
from spotguard.distributed import Agreement, PeerLostError

__all__ = ["Heartbeats", "HeartbeatMismatch"]

log = logging.getLogger("spotguard.run")


class HeartbeatMismatch(RuntimeError):
    """The ranks did not call ``run.heartbeat()`` at the same points (``agree_at_heartbeat=True``), or
    the Hugging Face callback's ranks were at different prediction steps of an evaluation."""


class Heartbeats:
    """A :class:`~spotguard.run.Run`'s agreement at ``run.heartbeat()``; see the module docstring."""

    def __init__(self, run: Any, enabled: bool) -> None:
        self.run = run
        self.enabled = enabled and run.agreement.enabled
        self._agreement = Agreement(share=run.agreement) if self.enabled else None
        self.count = 0
        self.active = False  # inside Run.steps(): every rank counts the same calls
        self.capture: Callable[[], tuple[int, dict[str, Any]] | None] = self._between_steps
        """(step done, the state to save as of its end) while this rank is between two steps, else
        None; the Lightning callback gives its own (the state it kept when a validation began)."""
        self._waiting_noted = False

    def boundary_marks(self) -> tuple[float, ...]:
        """The marks a boundary's exchange carries: heartbeat 0 (none), so that a rank at a heartbeat
        meeting it is told; none when heartbeats do not agree (the exchange as before)."""
        return (0.0, 0.0) if self.enabled else ()

    def check_boundary(self, decision: Any, done: int) -> None:
        """A boundary's exchange met a heartbeat's on some rank: say so (raises)."""
        if self.enabled and decision.marks_equal and not decision.marks_equal[0]:
            raise HeartbeatMismatch(self._mismatch(f"the boundary after step {done}"))

    def beat(self) -> bool:
        """One ``run.heartbeat()``: True when the ranks stopped here (``exit_on_stop=False``; it
        raises ``SystemExit(75)`` otherwise)."""
        if not self.enabled or not self.active:
            return False
        if self.run.stopped:  # stopped at an earlier heartbeat (exit_on_stop=False): no more exchanges
            return True
        self.count += 1
        if not self._agreement.due(self.count):
            return False
        run = self.run
        captured = self.capture()
        local = run._local_decision(run.step)
        try:
            decision = self._agreement.agree(self.count, local,
                                             marks=(self.count, -1 if captured is None else captured[0]))
        except PeerLostError as exc:
            run._peer_lost(run.step, exc)
        if not decision.marks_equal[0]:
            raise HeartbeatMismatch(self._mismatch(f"heartbeat {self.count}"))
        if not decision.stop:
            return False
        if captured is None or not decision.marks_equal[1]:
            if not self._waiting_noted:
                self._waiting_noted = True
                log.warning("a stop at run.heartbeat(): the ranks are not all between the same two steps "
                            "(before the first optimizer step?); the next boundary stops them")
            return False
        done, state = captured
        log.warning("a stop agreed at run.heartbeat() %d, between steps: every rank saves step %d", self.count, done)
        return run._stop(done, decision, state=state)

    def _between_steps(self) -> tuple[int, dict[str, Any]] | None:
        """What the optimizer hooks captured at the last step's end (:meth:`Between.clean`)."""
        captured = self.run._between.clean()
        if captured is None:
            return None
        done, rng_state, position = captured
        return done, as_captured(self.run.state, rng_state, position)

    def _mismatch(self, where: str) -> str:
        return (f"agreement at heartbeats: at {where} this rank's exchange met another rank's heartbeat "
                f"or boundary; every rank must call run.heartbeat() at the same points (the same "
                f"evaluation loop on every rank; Lightning's callback calls it at each validation batch "
                f"end), or turn the agreement off (Run(agree_at_heartbeat=False), "
                f"SpotguardCallback(agree_in_validation=False))")
