"""The notice timeline: for every terminating notice, what the emergency path did, and when.

Operators cannot otherwise tell a preemption that was handled from one that was lucky. So for
each terminating notice the daemon records its stages, each with its time and its seconds after
the notice was seen:

* ``seen`` (the daemon learnt of it; ``platform_at`` beside it when the payload says when the
  platform flipped it, a ``noticeTime``: no terminating endpoint watched today does), ``published`` (on the PUB socket), ``signalled``
  (the delivery signal, with the pids it reached);
* per registered client (``pid``): ``flagged`` (its stop flag was set: the ``ack`` request, or the
  time a safe report carries), ``stopped`` (the step it stopped at), then ``committed`` (its
  emergency save), ``already`` (that step was committed before), ``no_room`` (no save: the estimate
  ``estimate_s`` did not fit the ``seconds_left``) or ``save_failed``, and ``safe`` (its report);
* ``durable`` (a stopped client's step of its job reached the durable store), and ``gone`` (the
  daemon stopped with the notice open because the node is going: a node stop) or
  ``daemon_stopped`` (it stopped otherwise; the node's end is not knowable from here).

Each notice gets one outcome, counted once: ``saved`` (every registered client reported safe
before the deadline, none without a save it needed), ``no_room`` (a client had no time to save; its
last committed checkpoint stands), ``missed_deadline`` (the deadline passed before every client was
safe, or a client's report came after it), ``no_client`` (no client was registered when it was
seen and none took part), or ``cancelled`` (withdrawn before any of that, with clients, or by an
operator: ``spotguard notices cancel``, whose reason is ``cancelled by operator``). A notice
without a deadline cannot miss it.

Bounds: ``MAX_STAGES`` stages and ``MAX_JOBS`` jobs waited for per timeline (further ones counted
in ``jobs_left_out``), so a ``status`` reply stays far below the clients' 1 MiB limit; only proven
(``ipc://``) clients write to a timeline (:mod:`.handlers`).

A timeline stays open (``status`` shows it) until it has an outcome and, where a client committed,
its ``durable`` stage, at most ``LINGER_SECONDS`` after its outcome; then it joins the history.
Open timelines and the last :data:`~spotguard.protocol.MAX_HISTORY` closed ones are kept in
``<state_dir>/timelines.json`` (0600, written atomically by the housekeeping tick after a change,
never between a notice and its publication or in a client's request, and every ``ALIVE_SECONDS``
while one is open, so a daemon killed with a notice open leaves its last sign of life: the next run
closes that timeline with ``daemon_stopped`` at that time).

Exceptions: none; a state file that cannot be read is logged and ignored, one that cannot be
written is logged.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from spotguard.protocol import MAX_HISTORY, TERMINATING_KINDS, Notice, SafeRequest, utcnow

from spotguard_daemon.core.store import write_private_atomic

__all__ = ["Timelines", "OUTCOMES", "STAGES", "BY_OPERATOR"]

log = logging.getLogger(__name__)

STAGES = ("seen", "published", "signalled", "flagged", "stopped", "committed", "already", "no_room",
          "save_failed", "safe", "durable", "gone", "daemon_stopped")
OUTCOMES = ("saved", "no_room", "missed_deadline", "no_client", "cancelled")
BY_OPERATOR = "cancelled by operator"
"""The reason of a notice withdrawn with ``spotguard notices cancel``: outcome ``cancelled``."""
LINGER_SECONDS = 600.0
"""How long a timeline with an outcome waits for its ``durable`` stage before it joins the history."""
ALIVE_SECONDS = 5.0
MAX_STAGES = 512
"""Stages kept per timeline (a notice with thousands of clients keeps its first ones)."""
MAX_JOBS = 32
"""Jobs a timeline waits for a durable checkpoint of; the rest are counted (``jobs_left_out``)."""
MAX_JOB_CHARS = 128
REPLY_STAGES = 4096
"""Stages a history reply holds at most (older timelines are left out): it stays far below the
clients' 1 MiB reply limit."""
_SAVE_STAGE = {"committed": "committed", "already": "already", "no_room": "no_room", "failed": "save_failed"}


class Observer(Protocol):
    """Where the timeline's figures go (the daemon's :class:`~.metrics.Metrics`)."""

    def notice_stage(self, stage: str, seconds: float) -> None: ...
    def notice_outcome(self, outcome: str, no_client_streak: int) -> None: ...


class _Quiet:
    def notice_stage(self, stage: str, seconds: float) -> None:
        pass

    def notice_outcome(self, outcome: str, no_client_streak: int) -> None:
        pass


def _iso(when: datetime | None) -> str | None:
    return None if when is None else when.isoformat()


def _when(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def platform_time(notice: Notice) -> datetime | None:
    """When the platform flipped the notice, where its payload says so (a ``noticeTime``, as AWS's
    rebalance recommendations carry); None otherwise."""
    raw = notice.raw if isinstance(notice.raw, dict) else {}
    try:
        return datetime.fromisoformat(str(raw["noticeTime"]).replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None


class Timelines:
    """Open timelines by notice id, the bounded history, their file and their figures."""

    def __init__(self, path: Path | None = None, observer: Observer | None = None,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self._path, self._observer, self._clock = path, observer or _Quiet(), clock
        self._open: dict[str, dict[str, Any]] = {}
        self._history: deque[dict[str, Any]] = deque(maxlen=MAX_HISTORY)
        self._alive_at = 0.0
        self._dirty = False

    # ------------------------------------------------------------------ notices

    def seen(self, notice: Notice, clients: int) -> None:
        """A notice was announced; ``clients``: how many clients are registered now."""
        if notice.kind not in TERMINATING_KINDS or not notice.terminating:
            return
        line = self._open.get(notice.id) or self._reopen(notice)
        if line is not None:  # re-announced (a reschedule, or after a daemon restart)
            if _iso(notice.deadline) != line["deadline"]:
                line["deadline"] = _iso(notice.deadline)
                self._add(line, "rescheduled", self._clock(), detail=notice.detail[-200:])
            return
        line = {"id": notice.id, "kind": notice.kind.value, "platform": notice.platform,
                "source": notice.source, "deadline": _iso(notice.deadline),
                "seen": _iso(notice.received_at), "platform_at": _iso(platform_time(notice)),
                "clients_at_seen": clients, "stages": [], "outcome": None, "outcome_at": None,
                "jobs": {}}
        self._open[notice.id] = line
        self._add(line, "seen", notice.received_at)

    def stage(self, notice_id: str, stage: str, at: datetime | None = None, **extra: Any) -> None:
        """Record a daemon-side stage (``published``, ``signalled``) of an open timeline, at ``at``
        (default now)."""
        line = self._open.get(notice_id)
        if line is not None:
            self._add(line, stage, at or self._clock(), **extra)

    def ack(self, notice_ids: Iterable[str], pid: int, at: datetime) -> None:
        """A client set its stop flag at ``at`` (its ``ack`` request)."""
        for line in self._lines(notice_ids):
            self._flagged(line, pid, at)

    def safe(self, notice_ids: Iterable[str], pid: int, report: SafeRequest, job: str) -> None:
        """A client reported safe: its side of the stop, then ``safe`` now."""
        now = self._clock()
        for line in self._lines(notice_ids):
            if report.flagged_at is not None:
                self._flagged(line, pid, report.flagged_at)
            if report.stopped_at is not None:
                self._add(line, "stopped", report.stopped_at, pid=pid, step=report.step)
            if report.save is not None:
                at = report.committed_at if report.save == "committed" and report.committed_at else now
                self._add(line, _SAVE_STAGE[report.save], at, pid=pid, step=report.step,
                          estimate_s=report.estimate_s, seconds_left=report.seconds_left)
                if report.save in ("committed", "already") and report.step is not None:
                    self._wait_for(line, job[:MAX_JOB_CHARS], report.step)
            self._add(line, "safe", now, pid=pid)

    def all_safe(self, notice_id: str) -> None:
        """Every registered client (at least one) reported safe: the notice's outcome."""
        line = self._open.get(notice_id)
        if line is None or line["outcome"] is not None:
            return
        names = {s["stage"] for s in line["stages"]}
        deadline = _when(line["deadline"])
        late = deadline is not None and any(
            _when(s["at"]) > deadline for s in line["stages"] if s["stage"] in ("committed", "safe"))
        self._decide(line, "no_room" if "no_room" in names else "missed_deadline" if late
                     or "save_failed" in names else "saved")

    def durable(self, job: str, step: int) -> None:
        """A job's checkpoint of ``step`` became durable: the stage of timelines waiting for it."""
        for line in self._open.values():
            wanted = line["jobs"].get(job)
            if wanted is not None and wanted <= step:
                del line["jobs"][job]
                self._add(line, "durable", self._clock(), job=job, step=step)
        self.tick()

    def cancelled(self, notice_id: str, reason: str) -> None:
        """The notice was withdrawn (a platform cancel, a drill done, expiry, an operator); a timeline
        already closed (its deadline decided it) notes the reason too."""
        line = self._open.get(notice_id)
        if line is None:
            closed = next((c for c in reversed(self._history) if c["id"] == notice_id), None)
            if closed is not None and "cancelled" not in closed:
                closed["cancelled"], self._dirty = reason[:200], True
            return
        if line["outcome"] is None:  # an operator's cancel never counts against the node
            self._decide(line, "cancelled" if self._took_part(line) or reason == BY_OPERATOR else "no_client")
        line["cancelled"] = reason[:200]
        self.tick()

    def tick(self) -> None:
        """Decide what time decides (a deadline passed) and close the timelines that are done;
        rewrite the file every ``ALIVE_SECONDS`` while one is open. Called by housekeeping."""
        now, changed = self._clock(), False
        for line in list(self._open.values()):
            deadline = _when(line["deadline"])
            if line["outcome"] is None and deadline is not None and now > deadline:
                took_part = self._took_part(line)
                self._decide(line, "missed_deadline" if took_part or line["clients_at_seen"] else "no_client")
                changed = True
            decided = _when(line["outcome_at"])
            if decided is not None and (not line["jobs"] or (now - decided).total_seconds() > LINGER_SECONDS):
                self._close(line)
                changed = True
        if changed or self._dirty or (self._open and now.timestamp() - self._alive_at >= ALIVE_SECONDS):
            self._persist()

    def stopping(self, node_going: bool) -> None:
        """The daemon stops: ``gone`` (the node is going) or ``daemon_stopped`` on every open one;
        one that no client took part in, with none registered when seen, found no client."""
        for line in list(self._open.values()):
            self._add(line, "gone" if node_going else "daemon_stopped", self._clock())
            if line["outcome"] is None and not self._took_part(line) and not line["clients_at_seen"]:
                self._decide(line, "no_client")
        self._persist()

    # ------------------------------------------------------------------ queries

    def current(self) -> dict[str, Any] | None:
        """The newest open timeline, else the newest closed one (None before any notice)."""
        if self._open:
            return self._public(max(self._open.values(), key=lambda line: _when(line["seen"])))
        return self._public(self._history[-1]) if self._history else None

    def history(self, count: int) -> list[dict[str, Any]]:
        """The last ``count`` timelines, open ones included, newest first; fewer when they would hold
        more than ``REPLY_STAGES`` stages."""
        lines = sorted([*self._history, *self._open.values()], key=lambda line: _when(line["seen"]),
                       reverse=True)
        chosen, stages = [], 0
        for line in lines[:count]:
            stages += len(line["stages"])
            if chosen and stages > REPLY_STAGES:
                break
            chosen.append(self._public(line))
        return chosen

    # ------------------------------------------------------------------ internals

    def _lines(self, notice_ids: Iterable[str]) -> list[dict[str, Any]]:
        return [self._open[i] for i in notice_ids if i in self._open]

    def _reopen(self, notice: Notice) -> dict[str, Any] | None:
        """The closed timeline of this very notice (same id, seen at the same time), open again: a
        restarted daemon re-announces the notices it restored, which its housekeeping may have
        closed meanwhile."""
        for line in self._history:
            if line["id"] == notice.id and _when(line["seen"]) == notice.received_at:
                self._history.remove(line)
                self._open[line["id"]] = line
                return line
        return None

    @staticmethod
    def _wait_for(line: dict[str, Any], job: str, step: int) -> None:
        """Wait for a durable ``step`` of ``job``: at most ``MAX_JOBS`` jobs, the rest counted."""
        if job in line["jobs"] or len(line["jobs"]) < MAX_JOBS:
            line["jobs"][job] = max(step, line["jobs"].get(job, -1))
        else:
            line["jobs_left_out"] = line.get("jobs_left_out", 0) + 1

    def _flagged(self, line: dict[str, Any], pid: int, at: datetime) -> None:
        if not any(s["stage"] == "flagged" and s.get("pid") == pid for s in line["stages"]):
            self._add(line, "flagged", at, pid=pid)

    def _took_part(self, line: dict[str, Any]) -> bool:
        return any("pid" in s for s in line["stages"])

    def _add(self, line: dict[str, Any], stage: str, at: datetime, **extra: Any) -> None:
        if len(line["stages"]) >= MAX_STAGES:
            return
        self._dirty = True
        after = max(0.0, (at - _when(line["seen"])).total_seconds())
        line["stages"].append({"stage": stage, "at": _iso(at), "after_s": round(after, 6),
                               **{k: v for k, v in extra.items() if v is not None}})
        if stage in STAGES and stage != "seen":
            self._observer.notice_stage(stage, after)

    def _decide(self, line: dict[str, Any], outcome: str) -> None:
        line["outcome"], line["outcome_at"], self._dirty = outcome, _iso(self._clock()), True
        log.info("notice %s: %s", line["id"], outcome.replace("_", " "))
        self._observer.notice_outcome(outcome, self.no_client_streak())

    def no_client_streak(self) -> int:
        """How many of the newest decided notices in a row found no client."""
        streak = 0
        lines = sorted([*self._history, *self._open.values()], key=lambda line: _when(line["seen"]),
                       reverse=True)
        for line in lines:
            if line["outcome"] is None:
                continue
            if line["outcome"] != "no_client":
                break
            streak += 1
        return streak

    def _close(self, line: dict[str, Any]) -> None:
        del self._open[line["id"]]
        self._history.append(line)

    @staticmethod
    def _public(line: dict[str, Any]) -> dict[str, Any]:
        public = {k: v for k, v in line.items() if k != "jobs"}
        public["stages"] = sorted(line["stages"], key=lambda s: _when(s["at"]))
        public["waiting_for_durable"] = sorted(line["jobs"])
        return public

    # ------------------------------------------------------------------ persistence

    def _persist(self) -> None:
        self._alive_at, self._dirty = self._clock().timestamp(), False
        if self._path is None:
            return
        doc = {"version": 1, "alive_at": _iso(self._clock()), "open": list(self._open.values()),
               "history": list(self._history)}
        try:
            write_private_atomic(self._path, json.dumps(doc, separators=(",", ":")).encode())
        except OSError as exc:
            log.error("cannot write %s: %s (the notice history will not survive a restart)", self._path, exc)

    def restore(self, pending: set[str]) -> None:
        """Load the timelines a previous run left. Those it left open get ``daemon_stopped`` at its
        last sign of life (unless it recorded ``gone``); they stay open when their notice is still
        ``pending`` (restored by the notice store), else they join the history. Call once, at start."""
        if self._path is None or not self._path.exists():
            return
        try:
            doc = json.loads(self._path.read_bytes())
            alive = _when(doc.get("alive_at")) or self._clock()
            for line in doc["open"]:
                if not any(s["stage"] in ("gone", "daemon_stopped") for s in line["stages"]):
                    after = max(0.0, (alive - _when(line["seen"])).total_seconds())
                    line["stages"].append({"stage": "daemon_stopped", "at": _iso(alive), "after_s": after})
            lines = sorted([*doc["history"], *doc["open"]], key=lambda line: _when(line["seen"]))
            for line in lines[-MAX_HISTORY:]:
                if not isinstance(line["stages"], list) or line["outcome"] not in (None, *OUTCOMES) \
                        or not isinstance(line["jobs"], dict):
                    raise ValueError(f"timeline {line.get('id')!r} is malformed")
                if line in doc["open"] and line["id"] in pending:
                    self._open[line["id"]] = line
                else:
                    self._history.append(line)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable notice history %s: %s", self._path, exc)
            self._history.clear()
            self._open.clear()
