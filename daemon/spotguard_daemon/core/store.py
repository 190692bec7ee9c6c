"""The notice store: the one place that decides what is new, what was cancelled, and who is safe.

Sources come in two shapes. Polled watchers hand over *snapshots* (:meth:`NoticeStore.reconcile`):
an id not seen before is announced, an id this source listed last time and no longer lists is
cancelled, and an id seen again changes nothing (its first ``received_at`` is kept, so latency
figures and deadlines do not drift with every poll) unless its deadline moved by more than
``RESCHEDULE_SECONDS`` (an Azure or AWS event rescheduled under the same id): then the updated notice
is announced again under the same id (its detail says the platform rescheduled it), and clients
replace the one they hold. A notice restored from the state file keeps its stored deadline: when its
source first lists it again, the difference between the two deadlines is remembered as the restart's
shift (a deadline the watcher computed from the time it first saw the event, as on GCP, comes back
later by the restart's duration) and later polls are compared after removing it, so a restart never
moves a deadline, and a real reschedule by the platform still does. Push sources (a signal, a manual
``notify``) use :meth:`NoticeStore.add` and :meth:`NoticeStore.cancel`.

Listeners hear of a notice first, and the state file is written right after: the fsyncs take
milliseconds that must not stand between a platform's notice and the clients (a crash in between
loses only the re-announcement, and polled sources report their notice again on the next poll).
Pending notices are persisted to ``<state_dir>/notices.json`` after every change, written atomically
(temporary file, fsync, ``os.replace``, fsync of the directory, mode 0600), so a daemon that restarts
while a notice is pending announces it again to the clients that reconnect, unless its source is
not watched in the restarted daemon's configuration (an AWS notice left by a simulator run, and the
daemon now runs with ``--platform none``): that one is dropped, in one log line.

Deadlines. A manual notice (a drill, ``spotguard notify``) ends at its deadline (cancelled
``MANUAL_GRACE`` seconds after it, once the timeline has decided its outcome). Any other notice whose
deadline passed while this node is evidently still alive is *overdue*: it stays pending (``status``
shows it as overdue, the clients already stopping for it keep it), but it is no longer offered to
clients (:meth:`NoticeStore.offered`: the register and status replies, the heartbeats' pending ids),
so a job that starts after the deadline is not stopped by a preemption that did not come; the
store logs this once per notice. Notices whose deadline passed more than ``stale_after`` seconds
ago are dropped on load and by :meth:`NoticeStore.expire`, and so are manual notices without a
deadline received that long ago.

Listeners are plain callables, called synchronously in the order they were added; one that raises
is logged and does not stop the others (a broken webhook must not hide a notice from the clients).

Exceptions: none of its own; a state file that cannot be read is logged and ignored, one that
cannot be written is logged (the notice is still delivered, only not remembered across restarts).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Callable, Iterable, Sequence

from pydantic import ValidationError
from spotguard.protocol import Notice, utcnow
from spotguard.storage.file import atomic_write, make_private_dirs

from spotguard_daemon.core.watchers.manual import SOURCE as MANUAL_SOURCE

__all__ = ["NoticeStore", "Entry", "write_private_atomic"]

log = logging.getLogger(__name__)

STATE_VERSION = 1
RESCHEDULE_SECONDS = 1.0
MANUAL_GRACE = 1.0
"""Seconds after its deadline at which a manual notice is cancelled (the timeline's housekeeping tick
decides ``missed_deadline`` first)."""

AnnounceListener = Callable[[Notice], None]
CancelListener = Callable[[Notice, str], None]


@dataclass
class Entry:
    """A pending notice and the pids that reported being safe for it."""

    notice: Notice
    safe: set[int] = field(default_factory=set)
    ephemeral: bool = False
    """Not written to the state file (the daemon's own SIGTERM notice)."""
    restored: bool = False
    """Loaded from the state file and not yet listed again by its source."""
    shift: timedelta = timedelta(0)
    """How much later than the stored deadline the source reports it since a restart."""


def write_private_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new file, never half.

    The file is 0600 (it may name jobs and paths) in 0700 directories, fsynced before the rename,
    and the directory is fsynced after it so the rename itself survives a power cut.
    """
    make_private_dirs(path.parent)
    atomic_write(path, lambda handle: handle.write(data))


class NoticeStore:
    """Pending notices by id, with per-source snapshots, listeners, persistence and safe tracking."""

    def __init__(self, path: Path | None = None, *, stale_after: float = 3600.0,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self._path = path
        self._stale_after = timedelta(seconds=stale_after)
        self._clock = clock
        self._entries: dict[str, Entry] = {}
        self._snapshots: dict[str, set[str]] = {}
        self._on_announce: list[AnnounceListener] = []
        self._on_cancel: list[CancelListener] = []
        self._overdue_said: set[str] = set()

    # ------------------------------------------------------------------ listeners

    def on_announce(self, listener: AnnounceListener) -> None:
        self._on_announce.append(listener)

    def on_cancel(self, listener: CancelListener) -> None:
        self._on_cancel.append(listener)

    def _emit(self, listeners: Iterable[Callable], *args: object) -> None:
        for listener in listeners:
            try:
                listener(*args)
            except Exception:
                log.exception("notice listener %r failed", listener)

    # ------------------------------------------------------------------ sources

    def reconcile(self, source: str, notices: Sequence[Notice]) -> None:
        """Apply one snapshot from a polled source: announce new ids, cancel vanished ones."""
        current = {n.id: n for n in notices}
        previous = self._snapshots.get(source, set())
        self._snapshots[source] = set(current)
        gone = [i for i in previous - set(current) if self._remove(i, f"{source}: no longer pending")]
        new = [n for i, n in current.items() if i not in self._entries]
        for notice in new:
            self._entries[notice.id] = Entry(notice)
        moved = [n for n in (self._rescheduled(n) for n in current.values() if n not in new) if n]
        for notice in new + moved:
            self._emit(self._on_announce, notice)
        if gone or new or moved:
            self._persist()

    def _rescheduled(self, notice: Notice) -> Notice | None:
        """The updated notice when a known id came back with another deadline, else None."""
        entry = self._entries[notice.id]
        old = entry.notice.deadline
        if old is None or notice.deadline is None:
            entry.restored = False
            return None
        if entry.restored:
            entry.restored, entry.shift = False, notice.deadline - old
            return None
        new = notice.deadline - entry.shift
        if abs((new - old).total_seconds()) <= RESCHEDULE_SECONDS:
            return None
        log.info("notice %s rescheduled: deadline %s -> %s", notice.id, old.isoformat(), new.isoformat())
        detail = f"{notice.detail} (rescheduled by the platform; deadline was {old.isoformat()})"
        entry.notice = notice.model_copy(update={"received_at": entry.notice.received_at,
                                                 "deadline": new, "detail": detail[-1024:]})
        return entry.notice

    def add(self, notice: Notice, *, ephemeral: bool = False) -> bool:
        """Announce a pushed notice; False (and nothing happens) when its id is already pending.

        An ``ephemeral`` notice is not persisted, so a restarted daemon does not announce it again.
        """
        if notice.id in self._entries:
            return False
        self._entries[notice.id] = Entry(notice, ephemeral=ephemeral)
        self._emit(self._on_announce, notice)
        self._persist()
        return True

    def cancel(self, notice_id: str, reason: str = "") -> bool:
        """Withdraw a pending notice; False when no such notice is pending."""
        removed = self._remove(notice_id, reason)
        if removed:
            self._persist()
        return removed

    def _remove(self, notice_id: str, reason: str) -> bool:
        entry = self._entries.pop(notice_id, None)
        if entry is None:
            return False
        log.info("notice %s cancelled: %s", notice_id, reason)
        self._emit(self._on_cancel, entry.notice, reason)
        return True

    def expire(self) -> list[str]:
        """Cancel notices whose deadline passed more than ``stale_after`` ago, and manual ones past
        their deadline; say once of each other notice that it became overdue. Return the ids cancelled."""
        now = self._clock()
        ended = {i: "its deadline passed" if self._manual_ended(e.notice, now) else "expired"
                 for i, e in self._entries.items()
                 if self._manual_ended(e.notice, now) or self._is_stale(e.notice)}
        for notice_id, reason in ended.items():
            self._remove(notice_id, reason)
        if ended:
            self._persist()
        for notice in self.pending():
            if notice.id in self._overdue_said or notice.source == MANUAL_SOURCE:
                continue  # a manual notice ends at its deadline instead
            if self.overdue(notice):
                self._overdue_said.add(notice.id)
                log.warning("notice %s passed its deadline %s and this node is still alive: jobs that "
                            "start from now on are not stopped by it (kept visible as overdue until its "
                            "source withdraws it or %.0f s pass)", notice.id, notice.deadline.isoformat(),
                            self._stale_after.total_seconds())
        self._overdue_said.intersection_update(self._entries)
        return list(ended)

    def overdue(self, notice: Notice) -> bool:
        """Whether the notice's deadline passed (the node outlived it); see the module docstring."""
        return notice.deadline is not None and notice.deadline < self._clock()

    def _manual_ended(self, notice: Notice, now: datetime) -> bool:
        return notice.source == MANUAL_SOURCE and notice.deadline is not None \
            and notice.deadline + timedelta(seconds=MANUAL_GRACE) < now

    def _is_stale(self, notice: Notice) -> bool:
        """Deadline passed ``stale_after`` ago; a manual notice without a deadline (a drill) goes
        ``stale_after`` after it was received (no source would ever withdraw it)."""
        if notice.deadline is None:
            return notice.source == MANUAL_SOURCE and notice.received_at + self._stale_after < self._clock()
        return notice.deadline + self._stale_after < self._clock()

    # ------------------------------------------------------------------ queries

    def pending(self) -> list[Notice]:
        """Pending notices, oldest first (a snapshot: the metrics thread calls this too)."""
        return sorted((e.notice for e in list(self._entries.values())), key=lambda n: n.received_at)

    def offered(self) -> list[Notice]:
        """Pending notices a client that registers now is told of: those not :meth:`overdue`."""
        return [n for n in self.pending() if not self.overdue(n)]

    def get(self, notice_id: str) -> Notice | None:
        entry = self._entries.get(notice_id)
        return entry.notice if entry else None

    def mark_safe(self, notice_id: str, pid: int) -> bool:
        """Record that ``pid`` is safe for the notice; False when the notice is not pending."""
        return not self.mark_safe_all([notice_id], pid)

    def mark_safe_all(self, notice_ids: Iterable[str], pid: int) -> list[str]:
        """Record ``pid`` safe for each notice, writing the state file once; return unknown ids."""
        unknown, changed = [], False
        for notice_id in notice_ids:
            entry = self._entries.get(notice_id)
            if entry is None:
                unknown.append(notice_id)
            elif pid not in entry.safe:
                entry.safe.add(pid)
                changed = True
        if changed:
            self._persist()
        return unknown

    def safe_count(self, notice_id: str) -> int:
        entry = self._entries.get(notice_id)
        return len(entry.safe) if entry else 0

    def safe_pids(self, notice_id: str) -> frozenset[int]:
        entry = self._entries.get(notice_id)
        return frozenset(entry.safe) if entry else frozenset()

    # ------------------------------------------------------------------ persistence

    def _persist(self) -> None:
        if self._path is None:
            return
        doc = {"version": STATE_VERSION, "notices": [
            {"notice": e.notice.model_dump(mode="json"), "safe": sorted(e.safe)}
            for e in self._entries.values() if not e.ephemeral]}
        try:
            write_private_atomic(self._path, json.dumps(doc, indent=1).encode())
        except OSError as exc:
            log.error("cannot write %s: %s (pending notices will not survive a restart)", self._path, exc)

    def restore(self, sources: Iterable[str] | None = None) -> list[Notice]:
        """Load the notices a previous daemon left pending; they are pending (``status`` lists them)
        at once, and announced by :meth:`announce_restored`, which the daemon calls once its clients
        had time to reconnect and register (an announcement right after the bind reaches nobody).

        Call once, after the listeners are attached. Returns the notices loaded. The sources'
        snapshots are rebuilt too, so a watcher whose next poll no longer lists a notice cancels it.
        With ``sources`` (the sources this daemon watches now), a notice from any other source is
        dropped: nothing here could ever withdraw it.
        """
        restored, watched = [], None if sources is None else set(sources)
        for entry in self._read():
            if self._is_stale(entry.notice) or entry.notice.id in self._entries:
                continue
            if watched is not None and entry.notice.source not in watched:
                log.warning("dropping notice %s left pending by the previous run: its source %r is not "
                            "watched in this configuration", entry.notice.id, entry.notice.source)
                continue
            entry.restored = True
            self._entries[entry.notice.id] = entry
            self._snapshots.setdefault(entry.notice.source, set()).add(entry.notice.id)
            restored.append(entry.notice)
        self._persist()
        return restored

    def announce_restored(self, notices: Iterable[Notice]) -> list[Notice]:
        """Announce once each notice :meth:`restore` returned that is still pending unchanged (a
        reschedule seen meanwhile was announced already and is not repeated); return them."""
        announced = []
        for notice in notices:
            entry = self._entries.get(notice.id)
            if entry is None or entry.notice is not notice:
                continue
            if self.overdue(notice):
                log.warning("not re-announcing notice %s left pending by the previous run: its deadline "
                            "%s passed and this node is still alive (overdue)", notice.id,
                            notice.deadline.isoformat())
                continue
            log.info("re-announcing notice %s left pending by the previous run", notice.id)
            self._emit(self._on_announce, entry.notice)
            announced.append(entry.notice)
        return announced

    def _read(self) -> list[Entry]:
        if self._path is None or not self._path.exists():
            return []
        try:
            doc = json.loads(self._path.read_bytes())
            return [Entry(Notice.model_validate(item["notice"]), {int(p) for p in item.get("safe", [])})
                    for item in doc["notices"]]
        except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
            log.warning("ignoring unreadable state file %s: %s", self._path, exc)
            return []
