"""The checkpoint engine's front door: :class:`Checkpointer` (async save, verified load, retention).

Async mode with named wait points (after torchtitan's ``AsyncMode``): :meth:`Checkpointer.save`
waits for the previous save, snapshots the state into reusable CPU buffers (the only part the
training loop waits for, see :attr:`SaveStats.blocking_seconds`), then serialises, hashes, fsyncs
and commits in one background thread at lowered CPU priority, so training keeps its cores. Failures
of a background save surface at the next named wait point (:meth:`wait`, :meth:`save`,
:meth:`close`) as :class:`CheckpointError`; the previous checkpoint stays loadable throughout.

Sharded entries (a ``state_dict`` holding DTensors, e.g. FSDP2 ``fully_shard`` models and their
optimizers) are saved by every rank: the loop waits for a copy of each local shard into a reusable
CPU buffer; the background thread writes them with ``torch.distributed.checkpoint`` into the same
tmp dir and commit (see :mod:`.sharded`).

A checkpoint saved by another number of ranks (an elastic resume) loads too: every rank takes the
replicated entries from rank 0's part, sharded entries are resharded from every rank's DCP shards,
and a per-rank RNG state is re-derived for the new rank (:func:`spotguard.rng.derive`); rank 0 logs
the change once. A :class:`~spotguard.ResumableSampler` re-splits the rest of its epoch itself.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spotguard import rng
from spotguard._forkgate import torch_work
from spotguard._optim import hookable
from spotguard.checkpoint import commit, layout
from spotguard.checkpoint._budget import Budget
from spotguard.checkpoint._mounts import refuse_untrusted_rename
from spotguard.checkpoint._workers import Throttle, lower_priority
from spotguard.checkpoint.emergency import Emergency, LiveWriter, live_snapshot
from spotguard.checkpoint.errors import CheckpointCorruptError, CheckpointError
from spotguard.checkpoint.layout import CommitInfo
from spotguard.checkpoint.load import check, read_entries, read_manifest, restore
from spotguard.checkpoint.staging import Spec, Stager, tensor_specs

__all__ = ["Checkpointer", "SaveStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveStats:
    """Timings of the last completed save: the cost ``C`` of Young/Daly and the emergency budget."""

    step: int | None = None
    blocking_seconds: float = 0.0
    """Time ``save()`` held the training loop (wait for buffers excluded: snapshot only; an
    emergency save's whole write and commit)."""
    persist_seconds: float = 0.0
    """Write + hash + fsync + commit time of the background part (0 for an emergency save)."""
    bytes: int = 0
    """Bytes of tensor data written."""


def _import_sharded_soon() -> None:
    """Import the DTensor path (:mod:`.sharded`, which imports DCP: 0.1-0.35 s) in a thread of its
    own, when a DTensor can exist (``torch.distributed.tensor`` is imported: an optimizer's
    ``load_state_dict`` imports it) and it is not imported yet. It was on every resume's path (the
    restore waited for it) or in the first save's stall. A save that needs it first waits for this
    import (Python's module lock). The import registers torch code, so it is one fork-gated piece
    (:mod:`spotguard._forkgate`): a loader forking meanwhile waits for its end, once."""
    if "torch.distributed.tensor" not in sys.modules or "spotguard.checkpoint.sharded" in sys.modules:
        return

    def work() -> None:
        with torch_work():
            try:
                importlib.import_module("spotguard.checkpoint.sharded")
            except Exception as exc:  # noqa: BLE001 -- the save that needs it says what is wrong
                logger.debug("importing the DTensor path failed: %r", exc)

    threading.Thread(target=work, name="spotguard-import-sharded", daemon=True).start()


class Checkpointer:
    """Saves and restores full training state under ``root`` (see :mod:`.layout` for the layout).

    ``state`` maps names to objects with ``state_dict``/``load_state_dict``, tensors, or mappings
    of plain values and tensors; all are restored in place. With ``process_group`` every rank must
    construct the Checkpointer and call ``save``/``load_latest`` in the same order (collectives run
    on a private gloo group). Entries named in ``per_rank`` are saved by every rank, the rest by
    rank 0 only (data-parallel replicas are identical).

    Tuning: ``background_nice`` (niceness of the background threads) and an adaptive CPU budget keep
    a periodic save from slowing training (see :mod:`._budget`): from the step times ``Run`` reports
    (:meth:`observe_step`) and the CPUs' idle time over them, the first save starts from the cores
    the loop leaves idle (at ``background_inflation`` of a CPU, 0.03, where it leaves none; at
    ``background_cpu_share`` of a CPU without step times; None = no cap at all), and each save
    takes what the loop leaves spare while its steps stay within
    ``background_inflation`` (3 %) of their time before the save; ``background_inflation=None`` keeps
    the share fixed. A ``blocking`` save (the emergency one) uses neither and lifts the cap of the
    save it has to wait for. ``verify=False`` skips the checksums on load. Tensors of
    ``large_tensor_bytes`` or more get a file each. ``timeout`` bounds every wait for the other ranks.

    Retention: the newest ``keep`` committed checkpoints stay; older ones are deleted in the
    background after each commit is reported (never inside an emergency save, which leaves that to
    the next save), so at most ``keep`` + 1 are on disk (see :meth:`_apply_retention`).

    Memory: one staging copy of the state's tensors, kept for the Checkpointer's life (pinned with
    CUDA), allocated in the background by :meth:`load_latest`/:meth:`prepare` (see :mod:`.staging`).

    :param root: The checkpoint directory (created if missing).
    :param keep: Committed checkpoints kept; older ones are deleted after each commit.
    :param job_id: The job's id, written in each manifest and reported to the daemon.
    :param pin_memory: Pin the staging copy in page-locked memory (default: when CUDA is used).
    :param process_group: The ``torch.distributed`` group whose ranks save together.
    :param on_commit: Called with each :class:`CommitInfo` once a save is committed.
    :param verify: Check every file's sha256 on load.
    :param background_nice: Niceness of the background save threads (None: unchanged).
    :param background_cpu_share: The share of one CPU a background save starts with when no step
        times are known (None: no cap).
    :param background_inflation: The step-time slowdown a background save may cause (0.03: 3 %):
        the share adapts to it (:mod:`spotguard.checkpoint._budget`); None keeps the share fixed.
    :param large_tensor_bytes: Tensors of this many bytes or more get a file each.
    :param per_rank: Entries saved by every rank (the rest by rank 0 only).
    :param timeout: Seconds any wait for the other ranks may take.
    """

    def __init__(self, root: str | Path, *, keep: int = 3, job_id: str = "", pin_memory: bool | None = None,
                 process_group: Any = None, on_commit: Callable[[CommitInfo], None] | None = None,
                 verify: bool = True, background_nice: int | None = 19, background_cpu_share: float | None = 0.25,
                 background_inflation: float | None = 0.03,
                 large_tensor_bytes: int = 1 << 20, per_rank: Iterable[str] = ("rng",),
                 timeout: float = 600.0) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.root = Path(root).absolute()
        refuse_untrusted_rename(self.root)  # every rank: on another node, the root is another disk
        self.keep, self.job_id, self.verify, self.on_commit = keep, job_id, verify, on_commit
        self._nice, self._large, self._per_rank = background_nice, large_tensor_bytes, frozenset(per_rank)
        self._share = background_cpu_share
        self._throttle = Throttle(background_cpu_share)  # of the save in flight; validates the share now
        self._budget = Budget(background_cpu_share, background_inflation) \
            if background_cpu_share is not None and background_inflation is not None else None
        self._coord = _coordinator(process_group, timeout)
        self.rank = self._coord.rank if self._coord else 0
        self.world_size = self._coord.world_size if self._coord else 1
        self.resized_from: int | None = None
        """The world size of the checkpoint last read when it differs from this job's (elastic resume)."""
        if self._coord:  # a shared directory, or a node-local root per node (see .nodes)
            self._coord.discover(self.root)
        self._leads = self.rank == (self._coord.leader if self._coord else 0)
        """This rank creates and commits its root's checkpoints, and saves the replicated state."""
        self.node_ranks = self._coord.topology.ranks if self._coord and self._coord.node_local else None
        """The ranks sharing this node-local root (None: one root, shared or single-process)."""
        self.remote_shards: Callable[[int], Any] | None = None
        """``remote_shards(step)``: the durable store's files of ``step`` (``read_whole``,
        ``read_range``; :class:`spotguard.storage.shards.StoreShards`), for a resharding load on
        node-local roots; set by :class:`spotguard.Run` when the job has a store."""
        if self._leads:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            layout.remove_stale(self.root)
        self._stager = Stager(pin_memory, large_tensor_bytes)
        self._read_buffers: list[Any] = []
        self._shards: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last: CommitInfo | None = None
        self._stats = SaveStats()
        self.emergency = Emergency()
        """The emergency path's pinned chunks and measured bandwidth (see :meth:`emergency_seconds`)."""
        self._in_flight_bytes = 0
        self._hurry = threading.Event()
        """Set while a caller waits for the background thread: its retention stops deleting."""
        self._waiting_since: float | None = None
        self._emergency_saved = False
        self._closed = False
        self.skipped: list[dict[str, str]] = []
        """Checkpoints :meth:`load_latest` passed over as corrupt: ``{"path", "reason"}`` each."""

    @property
    def stats(self) -> SaveStats:
        return self._stats

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, step: int, state: Mapping[str, Any], *, epoch: int | None = None,
             blocking: bool = False) -> None:
        """Checkpoint ``state`` as ``step``. Returns once the snapshot is taken (or, with
        ``blocking``, once committed). Raises a pending background failure first.

        ``blocking`` is the emergency save, for when the loop is stopped (see :mod:`.emergency`): it
        lifts the cap of the save in flight and waits for it (a failure of that one is logged, not
        raised: the newest state still gets saved), then writes the state from its own memory, no
        snapshot copy, at the disk's speed."""
        if self._closed:
            raise CheckpointError("Checkpointer is closed")
        if blocking:
            return self._save_emergency(step, state, epoch)
        self.wait()
        started = time.perf_counter()
        snap = self._snapshot(state)
        stalled = time.perf_counter() - started
        meta = self._meta(step, epoch, snap)
        self._throttle = self._budget.begin() if self._budget else Throttle(self._share)
        self._in_flight_bytes = snap.nbytes
        self._hurry.clear()
        self._emergency_saved = False
        job = lambda: self._persist(snap, meta, stalled, self._throttle)  # noqa: E731
        self._thread = threading.Thread(target=self._run_background, args=(job,), name="spotguard-ckpt-persist")
        self._thread.start()

    def _save_emergency(self, step: int, state: Mapping[str, Any], epoch: int | None) -> None:
        self._throttle.lift()  # let the save in flight run at full speed
        try:
            self.wait()
        except CheckpointError as exc:  # it committed nothing; the state it held is older anyway
            logger.error("the save in flight failed (%s); the emergency save goes on", exc)
        if self._emergency_saved:  # a second one in this process (a process normally exits after
            self._apply_retention()  # one): the first one's leftovers go first, `keep` + 1 at most
        started = time.perf_counter()
        # One fork-gated piece, whole (its writer threads copy too): a stop's last act, and the loop
        # may be starting loader workers meanwhile (a notice between steps, spotguard._between).
        with torch_work():
            snap = self._snapshot(state, live=True)
            meta = self._meta(step, epoch, snap)
            stalled = time.perf_counter() - started
            self._run(lambda: self._persist(snap, meta, stalled, None, self.emergency.writer()), nice=None)
            self.wait()
        self.emergency.observe(snap.nbytes, time.perf_counter() - started)
        self._emergency_saved = True  # its retention waits for the next background save

    def observe_step(self, seconds: float) -> None:
        """One training step took ``seconds``: what the adaptive CPU budget of the background save
        steers by (see :mod:`._budget`). ``Run`` calls it at every step; call it from a loop of your own."""
        if self._budget is not None:
            self._budget.observe(seconds)

    def emergency_seconds(self, nbytes: int) -> float:
        """Expected notice-to-committed seconds of an emergency save of ``nbytes`` started now: at
        the emergency path's measured bandwidth (seeded by periodic saves, see :class:`.Emergency`),
        with the bytes of a save in flight added, since an emergency save waits for it."""
        return self.emergency.seconds(nbytes + (self._in_flight_bytes if self.in_flight else 0))

    def _meta(self, step: int, epoch: int | None, snap: Any) -> dict[str, Any]:
        return {"step": int(step), "epoch": epoch, "created": time.time(), "job_id": self.job_id,
                "world_size": self.world_size, "torch_version": torch.__version__,
                "entries": [e[0] for e in snap.entries]}

    def _snapshot(self, state: Mapping[str, Any], live: bool = False) -> Any:
        """Stage ``state`` (``live``: reference its tensors, see :mod:`.emergency`); entries holding
        DTensors are split off to DCP (see :mod:`.sharded`) and, like ``per_rank`` ones, saved by
        every rank."""
        dtensors: dict[str, Any] = {}
        if self._shard_stager() is not None:
            state, dtensors = self._shards.split(state)
        own = self._per_rank | {key.rsplit("/", 1)[0] for key in dtensors}
        names = None if self._leads else [n for n in state if n in own]
        snap = live_snapshot(state, names) if live else self._stager.snapshot(state, names)
        if not dtensors:
            return snap
        from spotguard.checkpoint.sharded import mark

        return mark(snap, dtensors)

    def _shard_stager(self) -> Any:
        """The DTensor stager once ``torch.distributed.tensor`` is imported (no DTensor can exist
        before). :meth:`prepare` imports its module in the background (:func:`_import_sharded_soon`),
        so that neither a restore nor the first save waits for that import."""
        if self._shards is None and "torch.distributed.tensor" in sys.modules:
            from spotguard.checkpoint.sharded import ShardStager

            self._shards = ShardStager()
        return self._shards

    def _persist(self, snap: Any, meta: dict[str, Any], stalled: float, throttle: Throttle | None,
                 writer: LiveWriter | None = None) -> CommitInfo:
        """Write and commit; a background save is reniced and CPU-capped, an emergency one
        (``writer``) is not."""
        started = time.perf_counter()
        background = threading.current_thread() is self._thread
        kwargs = {"large_bytes": self._large, "nice": self._nice if background else None,
                  "throttle": throttle, "writer": writer}
        if self._coord:
            info = self._coord.persist(self.root, snap, meta, **kwargs)
        else:
            info = commit.persist_local(self.root, snap, meta, **kwargs)
        persisted = time.perf_counter() - started
        if writer is not None:  # an emergency save held the loop throughout; nothing ran behind it
            stalled, persisted = stalled + persisted, 0.0
        else:
            self.emergency.seed(snap.nbytes, persisted)
        self._stats = SaveStats(meta["step"], stalled, persisted, snap.nbytes)
        return info

    def _run_background(self, job: Callable[[], CommitInfo]) -> None:
        self._apply_retention()  # what was left, whole, before writing: at most `keep` + 1 on disk
        self._run(job, self._nice)
        if self._budget is not None:
            self._budget.end()
        if self._error is not None:  # also raised at the next wait point; logged in case none comes
            logger.error("background checkpoint save to %s failed: %s", self.root, self._error)
        else:
            self._apply_retention(self._hurry.is_set)

    def _apply_retention(self, stop: Callable[[], bool] | None = None) -> None:
        """Delete the committed checkpoints beyond the newest ``keep`` (rank 0), off the save's clock.

        Deleting is slow (0.75 s per GiB on ext4 mounted with online ``discard``, measured) and a
        deadline cares only about the new checkpoint, so this runs in the background thread after
        the commit was reported (``on_commit``), is not counted in :attr:`SaveStats.persist_seconds`,
        never runs inside an emergency save, and stops between files as soon as a caller waits for
        the thread (:meth:`wait`). What is left goes, whole, at the start of the next background
        save, before it writes (so at most ``keep`` + 1 checkpoints are ever on disk), or at
        :meth:`close`."""
        if not self._leads:
            return
        try:
            commit.apply_retention(self.root, self.keep, self._last.path if self._last else None, stop)
        except Exception as exc:  # noqa: BLE001 - a failed delete must never cost a save; the next tries again
            logger.warning("could not delete old checkpoints under %s: %r", self.root, exc)

    def _run(self, job: Callable[[], CommitInfo], nice: int | None) -> None:
        lower_priority(nice)
        try:
            self._last = job()
        except BaseException as exc:  # handed to the next wait point
            self._error = exc
            return
        logger.info("checkpoint step %d committed at %s (%d bytes)", self._last.step, self._last.path,
                    self._last.size_bytes)
        if self.on_commit is not None:
            try:
                self.on_commit(self._last)
            except Exception:
                logger.exception("on_commit callback failed for step %d", self._last.step)

    def wait(self, timeout: float | None = None) -> CommitInfo | None:
        """Wait for the save in flight; the last commit, or None when none yet (or still running
        after ``timeout``). A background failure is raised here once, as CheckpointError. Waiting
        without a timeout lifts the save's CPU cap: the loop is not running, nothing to leave CPU for."""
        if self._thread is not None:
            if timeout is None:
                self._throttle.lift()
                self._hurry.set()
            self._waiting_since = time.monotonic()
            try:
                self._thread.join(timeout)
            finally:
                self._waiting_since = None
            if self._thread.is_alive():
                return None
            self._thread = None
        error, self._error = self._error, None
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"checkpoint save failed: {error!r}") from error
        return self._last

    def waiting(self) -> tuple[float, bool] | None:
        """``(seconds, exchanging)`` while a caller waits in :meth:`wait` for the save in flight: for
        how long, and whether that save is waiting for the other ranks right now (a save that is not
        is hung on this rank's own, see :mod:`spotguard._stall`); None while nobody waits."""
        since = self._waiting_since
        if since is None:
            return None
        return time.monotonic() - since, bool(self._coord is not None and self._coord.exchanging)

    def prepare(self, state: Mapping[str, Any], *, after_first_step: bool = True,
                specs: list[Spec] | None = None) -> None:
        """Allocate and pre-fault the staging buffers for ``state`` in a background thread (reniced
        and CPU-capped like a periodic save) so that the first save stalls no longer than later ones;
        returns at once. :meth:`load_latest` calls it. An optimizer without state yet (a fresh
        start) gets a one-time step hook that prepares again once its first step has created it.
        ``specs``: ``tensor_specs`` of the whole state, where the caller has them already."""
        if self._closed:
            return
        names = None if self.rank == 0 else [n for n in state if n in self._per_rank]
        _import_sharded_soon()
        try:
            specs = specs if specs is not None and names is None else tensor_specs(state, names)
        except Exception as exc:  # only an optimisation: the save itself reports what is wrong
            logger.debug("not preparing staging buffers: %r", exc)
            return
        self._stager.prepare(specs, nice=self._nice, cpu_share=self._share)
        fresh = [v for v in state.values() if isinstance(v, torch.optim.Optimizer) and not v.state]
        if after_first_step and fresh:
            self._prepare_after_first_step(state, fresh)

    def _prepare_after_first_step(self, state: Mapping[str, Any], optimizers: list[Any]) -> None:
        handles: list[Any] = []

        def first_step(*_: Any) -> None:
            for handle in handles:
                handle.remove()
            self.prepare(state, after_first_step=False)
        handles += [inner.register_step_post_hook(first_step) for inner in map(hookable, optimizers) if inner]

    def _candidates(self) -> list[Path]:
        return [p for _, p in layout.committed_dirs(self.root)]

    def latest(self) -> CommitInfo | None:
        """The newest structurally valid checkpoint (manifest, names, sizes; not hashed)."""
        for path in self._candidates():
            try:
                return check(path)
            except CheckpointCorruptError as exc:
                self._skip(path, exc)
        return None

    def load_latest(self, state: Mapping[str, Any]) -> CommitInfo | None:
        """Restore the newest valid checkpoint into ``state`` in place; None means a fresh start
        (no checkpoint at all). Corrupt or incomplete checkpoints are skipped with a warning and
        older ones tried next; when every one is corrupt, CheckpointCorruptError is raised."""
        self.wait()
        found = {step: path for step, path in layout.committed_dirs(self.root)}
        count = self._coord.agree(len(found), "max") if self._coord else len(found)
        below, held_by_all = 10**10, False
        for _ in range(count):  # the ranks agree on a step every rank has (node-local roots differ)
            step = max((s for s in found if s < below), default=-1)
            step = self._coord.agree(step, "min") if self._coord else step
            if step < 0:
                break
            entries = self._try_read(found[step], state) if step in found else None
            ok = entries is not None
            if self._coord:  # 2: read, 1: held but unreadable, 0: this rank's root lacks the step
                seen = self._coord.agree(2 if ok else int(step in found), "min")
                ok, held_by_all = seen == 2, held_by_all or seen >= 1
            below = step
            if ok:
                restore(state, entries)
                del entries
                specs = None
                if self._read_buffers:  # the restore's memory becomes the staging copy
                    specs = self._stager.adopt(self._read_buffers, state)
                self._read_buffers = []
                self.prepare(state, specs=specs)
                info = check(found[step])
                if self.resized_from is not None and self.rank == 0:
                    logger.warning("elastic resume: step %d was saved by %d ranks, this job has %d: replicated "
                                   "state from rank 0's part, sharded state resharded, the data position "
                                   "re-split over %d ranks, per-rank RNG streams re-derived (not bit-identical "
                                   "to a run on %d ranks)", info.step, self.resized_from, self.world_size,
                                   self.world_size, self.resized_from)
                return info
        if self._coord and count and not held_by_all:  # node-local roots that share no step
            raise CheckpointCorruptError(self._no_common_step(found))
        if count:  # silently starting over would let retention delete the evidence
            raise CheckpointCorruptError(f"none of the {count} checkpoints under {self.root} is valid "
                                         "(see the warnings); move them away to start fresh")
        self.prepare(state)
        return None

    def _no_common_step(self, found: dict[int, Path]) -> str:
        """What each rank holds, for the error when no step is held by every rank (collective)."""
        words = [0] * (3 * self.world_size)
        words[3 * self.rank: 3 * self.rank + 3] = [len(found), min(found, default=-1), max(found, default=-1)]
        summed = self._coord.all_reduce(words)
        held = [tuple(summed[3 * r: 3 * r + 3]) for r in range(self.world_size)]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, what in enumerate(held):
            groups.setdefault(what, []).append(rank)
        said = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}: "
                         + (f"{n} checkpoint{'s' if n > 1 else ''} (steps {lo}..{hi})" if n else "none")
                         for (n, lo, hi), ranks in groups.items())
        return (f"no checkpoint step is held by every rank, locally or in the durable store ({said}); a "
                f"node whose daemon was down uploaded nothing since the last global step. Relaunch on "
                f"nodes that hold a common step, or move {self.root} away on every node to start fresh")

    def _try_read(self, path: Path, state: Mapping[str, Any]) -> dict[str, Any] | None:
        try:
            manifest = read_manifest(path)
            base = _replicated_part(path, manifest)
            saved_world = manifest.get("world_size", 1)
            if not isinstance(saved_world, int) or saved_world < 1:
                raise CheckpointCorruptError(f"{path}: bad world_size {saved_world!r} in the manifest")
            resized = saved_world != self.world_size  # then every rank reads the replicated part only
            if "node" in manifest and not resized and f"rank-{self.rank}/{commit.TREE}" not in manifest["files"]:
                raise CheckpointCorruptError(f"{path}: this node's checkpoint holds no part of rank {self.rank}")
            # One process: the snapshot's positions are the part's (see Stager.adopt); else not adopted.
            self._read_buffers = []
            entries = read_entries(path, manifest, base, verify=self.verify,
                                   buffers=self._read_buffers if self._coord is None else None)
            self.resized_from = saved_world if resized else None
            if self.resized_from is not None:
                entries = self._rederive(entries)
            elif f"rank-{self.rank}" != base:
                entries = {k: v for k, v in entries.items() if k not in self._per_rank}
                if f"rank-{self.rank}/{commit.TREE}" in manifest["files"]:
                    entries.update(read_entries(path, manifest, f"rank-{self.rank}", verify=self.verify))
            if any(kind == "sharded" for kind, _ in entries.values()):
                from spotguard.checkpoint.sharded import load_entries

                remote = None  # node-local roots resharded: the other nodes' shards are in the store
                if "node" in manifest and self.resized_from is not None and self.remote_shards is not None:
                    remote = self.remote_shards(manifest["step"])
                load_entries(path, manifest, f"rank-{self.rank}", entries, state, verify=self.verify,
                             parts=self.resized_from, remote=remote)
            return entries
        except CheckpointCorruptError as exc:
            self._skip(path, exc)
            return None

    def _rederive(self, entries: dict[str, Any]) -> dict[str, Any]:
        """Elastic resume: every rank takes rank 0's entries; a per-rank RNG state (an entry of
        :mod:`spotguard.rng`'s format) is replaced by one derived for this rank and world."""
        out = dict(entries)
        for name in self._per_rank & entries.keys():
            kind, value = entries[name]
            if isinstance(value, dict) and value.get("format") == rng.FORMAT and "python" in value:
                out[name] = (kind, rng.derive(value, self.rank, self.world_size))
        return out

    def _skip(self, path: Path, exc: Exception) -> None:
        logger.warning("skipping checkpoint %s: %s", path, exc)
        self.skipped.append({"path": str(path), "reason": str(exc)})

    def close(self) -> None:
        """Wait for the save in flight (raising its failure), finish retention unless an emergency
        save was taken (the process is racing a deadline), and release the staging buffers."""
        try:
            self.wait()
            if not self._emergency_saved and not self._closed:
                self._apply_retention()
        finally:
            self._closed = True
            self._stager.release()
            if self._shards is not None:
                self._shards.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _replicated_part(path: Path, manifest: dict[str, Any]) -> str:
    """The part that holds the replicated state: rank 0's, or in a node-local checkpoint (see
    :mod:`.nodes`) its node leader's."""
    node = manifest.get("node")
    if node is None:
        return "rank-0"
    leader = node.get("leader") if isinstance(node, dict) else None
    if not isinstance(leader, int) or isinstance(leader, bool) or leader < 0:
        raise CheckpointCorruptError(f"{path}: bad node section in the manifest")
    return f"rank-{leader}"


def _coordinator(process_group: Any, timeout: float) -> Any:
    if process_group is None:
        return None
    from spotguard.checkpoint.distributed import Coordinator

    return Coordinator(process_group, timeout)


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
