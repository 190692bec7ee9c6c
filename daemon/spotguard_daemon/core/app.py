"""The daemon: builds every part from the settings and runs them on one asyncio loop.

Parts and their wiring (sources produce, the store decides, actions act)::

    Runner(watcher) --snapshot--> NoticeStore --announce/cancel--> Server.publish (PUB)
    signal / notify --add-------->            +--announce---------> Delivery (signal, hook, webhook)
    Server (ROUTER) --> RequestHandler --> store (safe), on_commit hook (storage engine)
                                      +--> GoodputLedger <--> DurableProgress (the store's copy)

Life cycle: lock the runtime directory, serve metrics, bind the sockets, load the notices a previous
run left pending (``status`` lists them at once; they are published on PUB and delivered again once,
``RESTORE_HEARTBEATS`` heartbeats later, when the clients that stayed connected have seen the new
daemon id and registered again, so the signal fallback reaches them; one that registers again up to
``RESTORE_LATE_SECONDS`` later still gets it), start one task per runner
plus the request, heartbeat and housekeeping loops, then tell systemd ``READY=1``. A daemon given a
``parent_pid`` (``spotguard daemon --parent-pid``: the private daemon of ``spotguard drill``) stops
as :meth:`Daemon.stop` does, raising nothing, once that process is no longer its parent: the
supervisor died, even of a SIGKILL, and the kernel reparented the daemon. The first
SIGTERM/SIGINT means the node is going or only the daemon is (:meth:`Daemon.node_stops`, setting
``signal.means``). A node stop with clients registered raises a ``signal`` notice due in
``signal.grace`` seconds (with none registered there is nobody to warn: it raises nothing, so a
stopped daemon never records a NO CLIENT notice nor feeds the no-client alert; it still finishes
the uploads in flight within the grace); the
daemon keeps serving until every registered client reported safe for it (or unregistered, or died) or the grace passed, then exits 0. A daemon stop (a
``systemctl restart`` for an upgrade) raises nothing: training goes on, pending notices stay in the
state file for the next run, clients reconnect to it. A second signal exits at once.

A platform that cannot be reached never stops the daemon: the runners back off and count errors.
No loop's failure stops it either: every background loop runs under :class:`~.tasks.Supervisor`,
which logs, counts and restarts a loop that fails, so what a client sent can at worst cost a loop a
restart.

Exceptions: :class:`~spotguard_daemon.core.server.ServerError` (sockets or runtime directory unusable)
and ``OSError`` (metrics port taken) escape :meth:`Daemon.run` at start-up; nothing escapes later.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
from pydantic import BaseModel
from spotguard import __version__
from spotguard.protocol import (TERMINATING_KINDS, CancelEvent, CommitRequest, DurableEvent, Notice,
                                NoticeEvent, utcnow)
from spotguard.storage.base import StoreError
from spotguard.storage.fresh_node import DEFAULT_JOB

from spotguard_daemon.core import systemd, uploads
from spotguard_daemon.core.abandon import in_thread
from spotguard_daemon.core.delivery import Delivery
from spotguard_daemon.core.goodput import GoodputLedger
from spotguard_daemon.core.goodput_store import DurableProgress, NoProgress
from spotguard_daemon.core.job_rates import JobRates
from spotguard_daemon.core.handlers import RequestHandler
from spotguard_daemon.core.metrics import Metrics
from spotguard_daemon.core.peer_tier import PeerTier
from spotguard_daemon.core.server import Server, ServerError, lock_runtime_dir
from spotguard_daemon.core.settings import Settings
from spotguard_daemon.core.store import NoticeStore
from spotguard_daemon.core.tasks import Supervisor
from spotguard_daemon.core.timeline import Timelines
from spotguard_daemon.core.watchers import detect
from spotguard_daemon.core.watchers import manual as manual_source
from spotguard_daemon.core.watchers import signal as signal_source
from spotguard_daemon.core.watchers.runner import Runner

__all__ = ["Daemon"]

log = logging.getLogger(__name__)

HOUSEKEEPING_SECONDS = 0.5
CHECK_SLOW_SECONDS = 10.0
"""A start-up store check still unanswered after this long is said (it may retry for minutes)."""
AIMED_GRACE_SECONDS = 5.0
"""A manual notice ends this long after the last client it was aimed at went, not at once: ``spotguard
run`` reports its plain job safe after the job exited, and the reaper may drop the job first."""
RESTORE_HEARTBEATS = 3
"""Heartbeats between binding and re-announcing restored notices: a client reconnects within one,
then registers and asks status."""
JOB_MEMORY_S = 600.0
"""How long after its last client went a job's parts are still taken from partners (peer tier)."""
RESTORE_LATE_SECONDS = 30.0
"""For this long after the re-announcement, a client that registers again late (a loaded node) still
gets the signal it missed, once; the register reply carries the notice too."""


class Daemon:
    """One daemon process. ``watchers`` overrides detection (tests); ``registry`` the metrics'."""

    def __init__(self, settings: Settings, *, watchers: list | None = None, registry=None,
                 on_ready: Callable[[], None] = lambda: None, parent_pid: int | None = None) -> None:
        self.settings = settings
        self.parent_pid = parent_pid
        """The supervisor whose death stops this daemon (:meth:`_check_parent`), or None."""
        self._on_ready = on_ready
        """Called once serving (the CLI says where commits may lie only once start-up succeeded)."""
        self.daemon_id = uuid.uuid4().hex[:12]
        self.started_at = utcnow()
        self.platform = settings.platform
        self.metrics = Metrics(registry)
        self.metrics_port: int | None = None
        self.store = NoticeStore(settings.state_dir / "notices.json")
        self.queue = uploads.from_settings(settings, registry=self.metrics.registry,
                                           on_durable=self._durable,
                                           urgent=lambda: bool(self.store.pending()))
        self.timeline = Timelines(settings.state_dir / "timelines.json", self.metrics)
        ledger = GoodputLedger(settings.state_dir / "goodput.json")
        self.progress = NoProgress() if self.queue.store is None else DurableProgress(
            self.queue.store, ledger, self.metrics,
            scratch=settings.runtime_dir / "progress-scratch",
            interval=settings.storage.progress_seconds, nice=settings.storage.upload_nice,
            urgent=self._terminating)
        cadence = settings.cadence
        self.rates = JobRates(ledger, platform=self.platform, node_mtbf_hours=cadence.node_mtbf_hours,
                              prior_weight=cadence.prior_weight, min_mtbf_seconds=cadence.min_mtbf_seconds)
        self.metrics.registry.register(self.rates)
        self.handler = RequestHandler(self.store, platform=self.platform,
                                      checkpoint_root=settings.checkpoint_root, info=self.info,
                                      on_change=self._clients_changed, on_commit=self._committed,
                                      known_step=self.queue.durable_step, metrics=self.metrics,
                                      ledger=ledger, recall=self.progress.recall, rates=self.rates,
                                      timeline=self.timeline,
                                      time_to_durable=self._time_to_safe)
        self.server = Server(pub_endpoint=settings.pub_endpoint,
                             request_endpoint=settings.request_endpoint, handler=self.handler,
                             pending_ids=lambda: [n.id for n in self.store.offered()],
                             daemon_id=self.daemon_id,
                             max_message_bytes=settings.zmq.max_message_bytes,
                             heartbeat_interval=settings.zmq.heartbeat_interval,
                             observe=self.metrics.request_served)
        self._watchers = watchers
        self._ackable: dict[str, Any] = {}
        self._aimed: dict[str, frozenset[int]] = {}
        """The clients registered when each manual notice was announced: the job it is aimed at."""
        self._aimed_gone: dict[str, float] = {}
        """When (monotonic) each manual notice's clients were first seen all gone."""
        self._acked: set[str] = set()
        self._signal_notice: Notice | None = None
        self._node_going = False
        self._drain_until = utcnow()
        self._force = False
        self._restoring = False
        self._settle_soon = False
        self._late: list[Notice] = []
        self._late_until = 0.0
        self.peer: PeerTier | None = None
        self._jobs: dict[str, float] = {}
        """Job id: when a client of it was last registered (0: now); the peer server's threads read
        it, so it is swapped whole, never changed in place."""
        self.tasks = Supervisor(self.metrics.task_restarts)

    @property
    def on_commit(self) -> Callable[[CommitRequest, Path], None]:
        return self.handler.on_commit

    @on_commit.setter
    def on_commit(self, hook: Callable[[CommitRequest, Path], None]) -> None:
        """Where accepted commits go: ``hook(request, resolved_path)``, called on the loop."""
        self.handler.on_commit = hook

    def info(self) -> dict[str, Any]:
        metrics = f"http://{self.settings.metrics.host}:{self.metrics_port}/metrics" \
            if self.metrics_port is not None else None
        return {"daemon_id": self.daemon_id, "version": __version__, "pid": os.getpid(),
                "platform": self.platform, "started_at": self.started_at.isoformat(),
                "pub_endpoint": self.server.pub_endpoint,
                "request_endpoint": self.server.request_endpoint, "metrics": metrics,
                "draining": self._node_going, "uploads": self.queue.status(),
                "peer": self.peer.status() if self.peer is not None else None,
                "signalled": self.delivery.recent() if hasattr(self, "delivery") else {}}

    # ------------------------------------------------------------------ run

    async def run(self) -> int:
        """Run until stopped by a signal (or :meth:`stop`); return the exit status."""
        lock = lock_runtime_dir(self.settings.runtime_dir)
        try:
            async with httpx.AsyncClient(trust_env=False) as metadata_http, \
                    httpx.AsyncClient(timeout=self.settings.delivery.timeout) as webhook_http:
                return await self._run(metadata_http, webhook_http)
        finally:
            os.close(lock)

    async def _run(self, metadata_http: httpx.AsyncClient, webhook_http: httpx.AsyncClient) -> int:
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self.delivery = Delivery(self.settings.delivery, self.handler.signallable_pids,
                                 http=webhook_http, outcome=self.metrics.delivered,
                                 refused=self.handler.signal_refused_pids)
        watchers = self._start_watching(metadata_http)
        try:
            self._start_serving({w.name for w in watchers})
            self._install_signal_handlers()
            self.queue.start()
            self.progress.start()
            self.tasks.keep("serve", self.server.serve)
            self.tasks.keep("heartbeats", self.server.heartbeats)
            self.tasks.keep("housekeeping", self._housekeeping)
            self.tasks.once("storage-check", self._check_storage())
            for watcher in watchers:
                self.tasks.keep(f"watcher {watcher.name}", self._runner(watcher))
            systemd.notify("READY=1")
            log.info("spotguard daemon %s ready (platform %s, %d watchers)", __version__,
                     self.platform, len(watchers))
            self._on_ready()
            await self._until_done()
        finally:
            await self._shutdown(watchers)
        return 0

    def _start_watching(self, http: httpx.AsyncClient) -> list:
        """Resolve ``auto`` to a platform and build its watchers (unless given to the constructor)."""
        self.platform = detect.detect_platform(self.settings)
        self.handler.platform = self.rates.platform = self.platform
        watchers = self._watchers
        if watchers is None:
            watchers = detect.build_watchers(self.settings, http, self.platform)
        if self.settings.azure.acknowledge:
            self._ackable = {w.name: w for w in watchers if hasattr(w, "acknowledge")}
        return watchers

    def _start_serving(self, sources: set[str]) -> None:
        """Serve metrics and the sockets, and restore the notices left pending from ``sources`` (the
        watchers' names; manual notices too; any other source is not watched now: dropped)."""
        self.metrics.set_info(__version__, self.platform)
        self.metrics.track_deadline(self.store.pending)
        self.metrics.track_notices(self.store.pending, self._clients_safe)
        if self.settings.metrics.enabled:
            host, port = self.settings.metrics.host, self.settings.metrics.port
            try:
                self.metrics_port = self.metrics.serve(host, port)
            except OSError as exc:
                raise ServerError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        if self.settings.peer.enabled:
            self.peer = PeerTier(self.settings, self._known_jobs)
        self.server.bind()
        self.store.on_announce(self._announce)
        self.store.on_cancel(self._cancel)
        restored = self.store.restore(sources | {manual_source.SOURCE})
        self.timeline.restore({n.id for n in restored})
        self.metrics.no_client_streak.set(self.timeline.no_client_streak())
        if restored:
            self.tasks.once("announce-restored", self._announce_restored(restored))

    async def _announce_restored(self, restored: list[Notice]) -> None:
        await asyncio.sleep(RESTORE_HEARTBEATS * self.settings.zmq.heartbeat_interval)
        self._restoring = True
        try:
            announced = self.store.announce_restored(restored)
        finally:
            self._restoring = False
        self._late_until = time.monotonic() + RESTORE_LATE_SECONDS
        self._late = [n for n in announced if n.terminating]

    def _runner(self, watcher) -> Callable[[], Awaitable[None]]:
        def sink(source, notices) -> None:
            self.store.reconcile(source.name, notices)

        return Runner(watcher, sink, self.settings.runner, self.metrics).run

    # ------------------------------------------------------------------ notices

    def _announce(self, notice: Notice) -> None:
        self.timeline.seen(notice, len(self.handler.clients))
        published = utcnow()  # before the send: a client may flag it before publish() returns
        self.server.publish(NoticeEvent(notice=notice))
        self.timeline.stage(notice.id, "published", at=published)
        self.metrics.notice_published(notice, latency=not self._restoring)
        log.warning("notice %s: %s on %s, deadline %s (%s)", notice.id, notice.kind.value,
                    notice.platform, notice.deadline.isoformat() if notice.deadline else "unknown",
                    notice.detail or notice.source)
        if notice.source == manual_source.SOURCE:
            self._aimed.setdefault(notice.id, frozenset(self.handler.clients))
        signalled = self.delivery.deliver(notice)
        if signalled:
            self.timeline.stage(notice.id, "signalled", pids=signalled)

    def _cancel(self, notice: Notice, reason: str) -> None:
        self._aimed.pop(notice.id, None)
        self._aimed_gone.pop(notice.id, None)
        if hasattr(self, "delivery"):
            self.delivery.cancelled(notice.id)
        self.server.publish(CancelEvent(id=notice.id, reason=reason))
        self.timeline.cancelled(notice.id, reason)

    def publish(self, event: BaseModel) -> None:
        """Publish an event to the subscribers."""
        self.server.publish(event)

    # ------------------------------------------------------------------ durability

    def _committed(self, request: CommitRequest, path: Path) -> None:
        """A client committed a checkpoint inside the checkpoint root: make it durable. The queue gets
        the path as named, not as resolved, so that it can refuse a symlinked checkpoint directory."""
        named = Path(os.path.abspath(Path(self.settings.checkpoint_root or path.parent) / request.path))
        job = request.job_id or DEFAULT_JOB

        def upload() -> None:
            self.queue.submit(request.job_id, named, request.step, request.size_bytes)

        if self.peer is not None:
            why = self._peer_first(job)
            if why and self.peer.submit(job, named, request.step, then=upload):
                log.warning("job %r: step %d goes to the partners first, then to the bucket: %s", job,
                            request.step, why)
                return
        upload()
        if self.peer is not None:
            self.peer.submit(job, named, request.step)

    def _peer_first(self, job: str) -> str | None:
        """Why a commit of ``job`` goes to the partners before the bucket: a terminating notice
        leaves less time than the bucket takes (or than nobody knows yet); None otherwise."""
        lefts = [s for n in self.store.pending() if n.kind in TERMINATING_KINDS
                 and (s := n.seconds_left()) is not None]
        if not lefts:
            return None
        left, bucket = max(min(lefts), 0.0), self.queue.time_to_durable(job)
        if bucket is None:
            return f"a notice leaves {left:.0f} s and the bucket's time to durable is not known yet"
        if bucket > left:
            return f"the bucket takes about {bucket:.0f} s and a notice leaves {left:.0f} s"
        return None

    def _terminating(self) -> bool:
        """Whether a terminating notice is pending (read by the goodput store's rate)."""
        return any(n.kind in TERMINATING_KINDS for n in self.store.pending())

    def _durable(self, job_id: str, step: int, location: str) -> None:
        """Called from the upload thread once a checkpoint is durable."""
        event = DurableEvent(job_id=job_id, step=step, location=location)
        self._loop.call_soon_threadsafe(self._made_durable, event)

    def _made_durable(self, event: DurableEvent) -> None:
        """On the loop: tell the clients, and the timelines waiting for that step."""
        self.publish(event)
        self.timeline.durable(event.job_id or DEFAULT_JOB, event.step)

    async def _check_storage(self) -> None:
        """Report a missing bucket or a refused credential at start-up, in one line, not at the
        first upload. Whatever the check raises, the daemon keeps serving notices; uploads retry, and
        so does the check (backing off to 5 minutes), saying once when the store is usable again.
        A check that does not answer within ``CHECK_SLOW_SECONDS`` (an SDK retrying inside one call)
        is said while it lasts; it runs on a thread a stopping daemon abandons (:mod:`.abandon`).
        Without a store (``storage.url = "none"``) there is nothing to check."""
        store, delay, slow_said = self.queue.store, 1.0, False
        while store is not None:
            check = asyncio.ensure_future(in_thread(store.check, "spotguard-storage-check"))
            try:
                done, _ = await asyncio.wait({check}, timeout=CHECK_SLOW_SECONDS)
                if not done and not slow_said:
                    slow_said = True
                    log.warning("durable storage %s: no answer to the start-up check for %.0f s; still "
                                "trying", self.queue.url, CHECK_SLOW_SECONDS)
                await check
            except asyncio.CancelledError:
                check.cancel()  # the daemon is stopping: abandon the call
                raise
            except Exception as exc:  # noqa: BLE001 - any SDK's transport error: never fatal
                if delay == 1.0:
                    log.error("durable storage unusable: %s", exc if isinstance(exc, StoreError) else repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 300.0)
                continue
            log.info("durable storage %s ready", self.settings.storage_url)
            return

    def _clients_changed(self) -> None:
        self.metrics.clients.set(len(self.handler.clients))
        now, current = time.monotonic(), {c.job_id or DEFAULT_JOB for c in self.handler.clients.values()}
        gone = {job: seen or now for job, seen in self._jobs.items() if job not in current}  # 0: was current
        self._jobs = {**{job: seen for job, seen in gone.items() if seen > now - JOB_MEMORY_S},
                      **dict.fromkeys(current, 0.0)}
        if hasattr(self, "_changed"):
            self._changed.set()
            if not self._settle_soon:  # once per burst of requests: each pass is notices x clients
                self._settle_soon = True
                self._loop.call_soon(self._settle)

    def _time_to_safe(self, job: str) -> float | None:
        """Seconds a commit of ``job`` takes to be safe off this node (the cadence's floor): to
        durable in the store, or to the partners' copy when the peer tier has it sooner."""
        known = [t for t in (self.queue.time_to_durable(job),
                             self.peer.time_to_copy(job) if self.peer is not None else None) if t is not None]
        return min(known) if known else None

    def _known_jobs(self) -> set[str]:
        """Jobs a partner may push parts of: registered here now, or within ``JOB_MEMORY_S`` (the
        last save of a job reaches the partner after the partner's own ranks finished)."""
        now = time.monotonic()
        return {job for job, seen in self._jobs.items() if not seen or seen > now - JOB_MEMORY_S}

    def _settle(self) -> None:
        self._settle_soon = False
        for notice in self.store.pending():  # before a drill is withdrawn for it
            if self._all_safe(notice.id, need_one=True):
                self.timeline.all_safe(notice.id)
        self._signal_late()
        self._acknowledge_ready()
        self._complete_manual()

    def _signal_late(self) -> None:
        """Signal clients that registered again only after a restored notice was re-announced."""
        if not self._late:
            return
        if time.monotonic() > self._late_until:
            self._late = []
            return
        pending = {n.id for n in self.store.pending()}
        for notice in self._late:
            if notice.id in pending and (sent := self.delivery.send_signal(notice, missed_only=True)):
                self.timeline.stage(notice.id, "signalled", pids=sent)

    def _complete_manual(self) -> None:
        """A manual notice (a drill, a scripted stop) has done its job once every registered client
        reported safe, or ``AIMED_GRACE_SECONDS`` after none of the clients it was aimed at (those
        registered when it was announced) is registered any more: withdraw it, so the identical
        command relaunched on this node trains instead of stopping again at once. Platform notices
        stay: their machine is going away regardless (past their deadline they are only overdue: see
        :mod:`.store`)."""
        for notice in self.store.pending():
            if notice.source != manual_source.SOURCE:
                continue
            aimed = self._aimed.get(notice.id)
            if self._all_safe(notice.id, need_one=True):
                self.store.cancel(notice.id, "every registered client reported safe")
            elif aimed and not any(key in self.handler.clients for key in aimed):
                gone = self._aimed_gone.setdefault(notice.id, time.monotonic())
                if time.monotonic() - gone >= AIMED_GRACE_SECONDS:
                    self.store.cancel(notice.id, "the job it was aimed at ended")

    def _clients_safe(self) -> int:
        """Registered clients safe for every pending terminating notice (all of them when none is
        pending). Read by the metrics thread, so it only takes snapshots and unregisters nobody."""
        pids = list(self.handler.clients)  # keyed as safe reports are (peers.key_of)
        for notice in self.store.pending():
            if notice.kind in TERMINATING_KINDS:
                safe = self.store.safe_pids(notice.id)
                pids = [pid for pid in pids if pid in safe]
        return len(pids)

    def _all_safe(self, notice_id: str, *, need_one: bool = False) -> bool:
        """Every registered client reported safe for the notice; with ``need_one``, also at least one
        pid did. That pid need not be registered still: a supervisor (``spotguard run``) reports its
        job's processes safe after they exited, and the reaper may have dropped them by then. O(1)
        while fewer pids reported safe than are registered (the usual case)."""
        clients, count = self.handler.clients, self.store.safe_count(notice_id)
        if (need_one and count == 0) or count < len(clients):
            return False
        safe = self.store.safe_pids(notice_id)
        return all(pid in safe for pid in clients)

    def _acknowledge_ready(self) -> None:
        """Start Azure events early once every client is safe (at least one), or at the deadline."""
        for notice in self.store.pending():
            watcher = self._ackable.get(notice.source)
            if watcher is None or notice.id in self._acked:
                continue
            left = notice.seconds_left()
            if (left is not None and left <= 0) or self._all_safe(notice.id, need_one=True):
                self._acked.add(notice.id)
                self.tasks.once("acknowledge", self._acknowledge(watcher, notice))

    async def _acknowledge(self, watcher, notice: Notice) -> None:
        raw = notice.raw if isinstance(notice.raw, dict) else {}
        event_id = raw.get("EventId") or notice.id
        try:
            await watcher.acknowledge([event_id])
            log.info("acknowledged event %s", event_id)
        except Exception as exc:  # the platform's fault must not stop the daemon
            log.warning("acknowledging event %s failed: %s", event_id, exc)

    # ------------------------------------------------------------------ housekeeping and stop

    async def _housekeeping(self) -> None:
        watchdog = systemd.watchdog_interval()
        loop = asyncio.get_running_loop()
        next_ping = loop.time()
        # The timeline before expire: a deadline decides the outcome, then a manual notice ends.
        steps: list[tuple[str, Callable[[], object]]] = [
            ("timeline", self.timeline.tick), ("expire", self.store.expire),
            ("goodput flush", self.handler.ledger.flush),
            ("goodput store", self.progress.tick), ("job rates", self.rates.snapshot),
            ("reap", lambda: self.metrics.clients.set(self.handler.reap())),
            ("acknowledge", self._acknowledge_ready), ("manual notices", self._complete_manual),
            ("parent", self._check_parent)]
        while True:
            for name, step in steps:  # one failing step never stops the others nor the watchdog
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - logged and counted, tried next pass
                    self.tasks.failed(f"housekeeping: {name}", exc)
            if watchdog is not None and loop.time() >= next_ping:
                systemd.notify("WATCHDOG=1")
                next_ping = loop.time() + watchdog
            await asyncio.sleep(min(HOUSEKEEPING_SECONDS, watchdog or HOUSEKEEPING_SECONDS))

    def parent_gone(self) -> bool:
        """Whether the ``parent_pid`` given is no longer this process's parent. The parent pid
        the kernel reports changes the moment the parent dies (the daemon is reparented), so a
        recycled pid can never pass for the parent."""
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _check_parent(self) -> None:
        """Stop, raising no notice, once the supervisor that started this daemon is gone."""
        if self.parent_gone():
            log.warning("the process that started this daemon (pid %d) is gone: stopping",
                        self.parent_pid)
            self.parent_pid = None
            self.stop()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in signal_source.HANDLED:
            loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        if self._node_going or self._force:
            log.warning("second signal: exiting now")
            self._force = True
            self._changed.set()
            return
        if not self.node_stops():
            log.warning("%s: the daemon stops, the node does not (signal.means=%s); no notice, "
                        "training goes on", signal_source.signal_name(signum), self.settings.signal.means)
            self.stop()
            return
        self._node_going = True
        grace = self.settings.signal.grace
        self._drain_until = utcnow() + timedelta(seconds=grace)
        if not self.handler.clients:  # nobody to warn: no notice, so no NO CLIENT outcome, no alert
            log.info("%s: stopping; no client is registered, so no notice is raised%s",
                     signal_source.signal_name(signum),
                     "" if self.queue.idle() else f" (uploads in flight get up to {grace:g} s)")
        else:
            notice = signal_source.signal_notice(signum, grace=grace, platform=self.platform)
            self._signal_notice = notice
            self.store.add(notice, ephemeral=True)
        self._stop.set()

    def node_stops(self) -> bool:
        """Whether a SIGTERM/SIGINT to the daemon means the node (container, pod) is going: see
        ``signal.means``; ``auto`` asks systemd when systemd runs the daemon, else says yes."""
        means = self.settings.signal.means
        if means != "auto":
            return means == "node"
        return not systemd.under_systemd() or systemd.system_stopping()

    def stop(self) -> None:
        """Exit without a notice and without waiting for clients (embedding, tests)."""
        self._force = True
        self._stop.set()
        self._changed.set()

    async def _until_done(self) -> None:
        """After a node stop: serve until the clients of its notice (if any) are safe and the uploads
        durable (and copied to the partners), within ``signal.grace``."""
        await self._stop.wait()
        notice = self._signal_notice
        while self._node_going and not self._force:
            left = (self._drain_until - utcnow()).total_seconds()
            copied = self.peer is None or self.peer.idle()  # a copy may still have its upload to queue
            if (notice is None or self._all_safe(notice.id)) and copied and self.queue.idle():
                log.info("%s%s; stopping", "no client to wait for" if notice is None else
                         "every registered client is safe",
                         "" if self.queue.store is None else " and every commit durable")
                return
            if left <= 0:
                log.warning("signal grace of %gs passed; stopping", self.settings.signal.grace)
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, HOUSEKEEPING_SECONDS))
            except asyncio.TimeoutError:
                pass

    async def _shutdown(self, watchers: list) -> None:
        systemd.notify("STOPPING=1")
        self.timeline.stopping(node_going=self._node_going)
        await self.tasks.cancel_all()
        await self.delivery.drain(timeout=2.0)
        for watcher in watchers:
            try:
                await watcher.aclose()
            except Exception as exc:
                log.debug("closing watcher %s: %s", getattr(watcher, "name", watcher), exc)
        if self.peer is not None:
            self.peer.close()  # first: an upload that waited for its peer copy is queued (journaled) now
        self.queue.close(timeout=1.0)  # a node stop waited for uploads already; a stalled one is abandoned
        self.progress.close()
        self.handler.ledger.flush(force=True)
        self.server.close()
        self.metrics.close()
        log.info("spotguard daemon stopped")
