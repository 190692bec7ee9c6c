"""Exact resume for ``DistributedDataParallel``: the gradient bucket layout DDP really built.

DDP all-reduces gradients bucket by bucket. A new DDP's first iteration uses its first layout (one
bucket, or buckets in parameter order with ``find_unused_parameters``); after the first iteration
that synchronised gradients, DDP rebuilds its buckets once, in the order the gradients became ready
in that backward (:meth:`Reducer._rebuild_buckets`, at the start of the next forward). That order
is not the reversed parameter order in general: under ``torch.autocast`` a Linear's weight gradient
is ready before its bias, shared weights and control flow reorder more. A relaunched process's new
DDP would all-reduce its first steps in another layout than the uninterrupted run's same steps,
and with three or more ranks the ring all-reduce then adds each element in another order: the last
bits differ and the runs drift apart. (Two ranks are unaffected: a sum of two is the same either way.)

So the layout is part of the checkpoint. :class:`Layouts` is the state entry ``ddp_layout``
(:data:`ENTRY`) that :class:`spotguard.Run` adds when its state holds a DDP (the Lightning callback
gives it ``trainer.strategy.model``; the Hugging Face callback writes the same record as
:data:`FILE` into the Trainer's checkpoint directory, for ``trainer.model_wrapped``):

* at every save, :meth:`Layouts.settle` runs on every rank (a collective: DDP's rebuild broadcasts
  rank 0's bucket indices): it makes a rebuild that is due happen now rather than at the next
  forward (the same rebuild, from the same recorded order) and refreshes DDP's logging data, whose
  ``rebuilt_per_bucket_param_indices`` and ``rebuilt_bucket_sizes`` then name the real layout;
* :meth:`Layouts.state_dict` (rank 0) records it, JSON-able::

      {"restorable": true, "why": null, "world_size": 3,
       "ddps": {"model": {"restorable": true, "why": null, "rebuilt": true, "params": 14,
                          "buckets": [[12, 13, 10, 11, 8], [9, 6, 7], ...], "bucket_bytes": [...]}}}

  ``rebuilt: false``: DDP has not rebuilt (no synchronised backward yet, or
  ``find_unused_parameters=True`` without ``static_graph``, where DDP never rebuilds): a new DDP
  starts in the same layout, nothing to restore. ``restorable: false`` with ``why``: the layout
  cannot be given back (a comm hook, DDP-native mixed precision, the Python reducer of compiled
  autograd, ``$DDP_SET_LAST_BUCKET_AS_SMALL``, a torch without the internals used here); warned
  about once, at the first save, when the job has three or more ranks (where it matters);
* on resume :meth:`Layouts.restore` gives each DDP, before its first step, a reducer with exactly
  the recorded buckets (``static_graph`` kept). That reducer rebuilds once more after its first
  synchronised backward, from that backward's order: the same layout for a model whose backward
  readies gradients in the same order every iteration (data-dependent control flow that changes
  the order between iterations is not exact). A checkpoint without the record (written before
  spotguard recorded it) gets the old guess: the reversed parameter order cut at DDP's limits.

This uses DDP internals (``_build_params_for_reducer``, ``dist.Reducer``, ``reducer._rebuild_buckets``,
the logging data); anything unexpected leaves the DDP as it was, logged, never a failed start.
Nothing is replaced below three ranks.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)

__all__ = ["ENTRY", "FILE", "Layouts", "align_buckets", "enclosing", "entries", "is_ddp", "restore", "settle",
           "trainer_layouts"]

ENTRY = "ddp_layout"
"""The name of the state entry (and the checkpoint entry) holding :class:`Layouts`' record."""

FILE = "spotguard-ddp-layout.json"
"""The same record beside a Hugging Face Trainer checkpoint (its directory holds no spotguard state)."""

_MIN_RANKS = 3
_MAX_FILE = 1 << 20
"""The most bytes of :data:`FILE` read (a layout names each parameter once: a few bytes each)."""


def _ddp_class() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # torch without distributed
        return None
    return DistributedDataParallel


def is_ddp(value: Any) -> bool:
    cls = _ddp_class() if "torch" in sys.modules else None
    return cls is not None and isinstance(value, cls)


def entries(state: Mapping[str, Any]) -> dict[str, "Layouts"]:
    """``{ENTRY: Layouts(...)}`` for the DDPs among ``state``'s values (to merge into it), else ``{}``."""
    ddps = {name: value for name, value in state.items() if is_ddp(value)}
    return {ENTRY: Layouts(ddps)} if ddps and ENTRY not in state else {}


def enclosing(module: Any, depth: int = 12) -> Any:
    """The DDP wrapping ``module`` among the local variables of the calling frames, else None.

    For callbacks that are handed the bare model (the Hugging Face Trainer's ``model=``) while the
    Trainer's frames hold the DDP it trains (``model``, ``trainer.model_wrapped``)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        for value in list(frame.f_locals.values()):
            for candidate in (value, _wrapped(value)):
                if is_ddp(candidate) and candidate.module is module:
                    return candidate
        frame = frame.f_back
    return None


def _wrapped(value: Any) -> Any:
    """A Trainer's ``model_wrapped``, read from the instance's own attributes (no property runs)."""
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except Exception:  # noqa: BLE001 - no __dict__
        return None
    return attributes.get("model_wrapped") if isinstance(attributes, dict) else None


def settle(state: Mapping[str, Any]) -> None:
    """:meth:`Layouts.settle` of ``state``'s :data:`ENTRY`, if it has one (every rank, every save)."""
    layouts = state.get(ENTRY)
    if isinstance(layouts, Layouts):
        layouts.settle()


def restore(state: Mapping[str, Any]) -> int:
    """:meth:`Layouts.restore` of ``state``'s :data:`ENTRY` (after a load); 0 without one."""
    layouts = state.get(ENTRY)
    return layouts.restore() if isinstance(layouts, Layouts) else 0


def trainer_layouts(module: Any, directories: Iterable[str | os.PathLike[str]]) -> "Layouts | None":
    """Layouts of the DDP a framework's frames hold around ``module`` (:func:`enclosing`), None
    without one; on a resume (``directories``: where the checkpoint resumed from may be) the
    :data:`FILE` found first is restored into it."""
    ddp = enclosing(module)
    if ddp is None:
        return None
    layouts = Layouts({"model": ddp})
    found = [Path(d) for d in directories]
    if found:
        layouts.read(next((d for d in found if (d / FILE).is_file()), found[0]))
        layouts.restore()
    return layouts


class Layouts:
    """The checkpoint entry :data:`ENTRY`: the bucket layout of each named DDP (module docstring)."""

    def __init__(self, ddps: Mapping[str, Any]) -> None:
        self.ddps = {name: ddp for name, ddp in ddps.items() if is_ddp(ddp)}
        self.loaded: Mapping[str, Any] | None = None
        """The record of the checkpoint loaded, None when it had none (or nothing was loaded)."""
        self._restored: dict[str, dict[str, Any]] = {}
        self._warned = False

    def settle(self) -> None:
        """Every rank, at every save, before :meth:`state_dict`: see the module docstring. The
        first one warns (rank 0, three or more ranks) about a layout that cannot be restored."""
        for ddp in self.ddps.values():
            if _obstacle(ddp) is None:
                try:
                    _settle(ddp)
                except Exception as exc:  # noqa: BLE001 - internals moved: the record says so
                    log.debug("could not settle DDP's bucket layout: %s", exc)
        if not self._warned:
            self._warned = True
            self._warn()

    def _warn(self) -> None:
        import torch.distributed as dist

        why = _reasons({name: _record(ddp) for name, ddp in self.ddps.items()})
        world = max((_world_size(ddp) for ddp in self.ddps.values()), default=1)
        if why and world >= _MIN_RANKS and dist.get_rank() == 0:
            log.warning("DDP's gradient bucket layout cannot be restored on resume (%s): with %d ranks "
                        "the steps after a resume may differ in the last bits from an uninterrupted "
                        "run", why, world)

    def state_dict(self) -> dict[str, Any]:
        records = {}
        for name, ddp in self.ddps.items():
            live = _record(ddp)  # a restored layout stands until the new reducer has rebuilt
            fresh = live["restorable"] and not live.get("rebuilt")
            records[name] = self._restored[name] if fresh and name in self._restored else live
        why = _reasons(records)
        world = max((_world_size(ddp) for ddp in self.ddps.values()), default=1)
        return {"restorable": not why, "why": why or None, "world_size": world, "ddps": records}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = state

    def restore(self) -> int:
        """Give each DDP the loaded layout (the old guess without one); how many were given one."""
        records = (self.loaded or {}).get("ddps") if isinstance(self.loaded, Mapping) else None
        if not isinstance(records, Mapping):
            log.info("the checkpoint has no record of DDP's bucket layout (written before spotguard "
                     "kept one): guessing it")
            return align_buckets(self.ddps.values())
        restored = 0
        for name, ddp in self.ddps.items():
            record = records.get(name)
            if isinstance(record, Mapping) and _restore(ddp, record, name):
                self._restored[name] = dict(record)
                restored += 1
        return restored

    def save_beside(self, directory: str | os.PathLike[str], write: bool) -> None:
        """At a framework's save, on every rank: :meth:`settle`, then with ``write`` (rank 0) the
        record as :data:`FILE` into the checkpoint ``directory``, if it exists."""
        self.settle()
        if write and Path(directory).is_dir():
            self.write(directory)

    def write(self, directory: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` as :data:`FILE` into ``directory`` (the caller's rank 0), through
        a new file (never through a link found there) renamed over it."""
        path = Path(directory) / FILE
        tmp = path.with_name(f".{FILE}.tmp")
        tmp.unlink(missing_ok=True)
        with open(tmp, "x") as out:
            out.write(json.dumps(self.state_dict()))
        os.replace(tmp, path)

    def read(self, directory: str | os.PathLike[str]) -> None:
        """Load :data:`FILE` from ``directory``: a regular file (no link, no FIFO) of at most
        :data:`_MAX_FILE` bytes; anything else loads nothing (the old guess then applies)."""
        try:
            fd = os.open(Path(directory) / FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as file:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError("not a regular file")
                self.loaded = json.loads(file.read(_MAX_FILE + 1)[:_MAX_FILE])
        except (OSError, ValueError) as exc:
            log.info("no DDP bucket layout beside the checkpoint %s (%s)", directory, exc)
            self.loaded = None


# ---------------------------------------------------------------------- reading the layout


def _reasons(records: Mapping[str, Mapping[str, Any]]) -> str:
    """``"<name>: <why>"`` of each record that is not restorable, joined; "" when all are."""
    return "; ".join(f"{name}: {r['why']}" for name, r in records.items() if not r["restorable"])


def _world_size(ddp: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(ddp.process_group)


def _rebuilds(ddp: Any) -> bool:
    """Whether DDP rebuilds its buckets after its first iteration (it never does with
    ``find_unused_parameters`` and no ``static_graph``)."""
    return bool(ddp.static_graph or not ddp.find_unused_parameters)


def _obstacle(ddp: Any) -> str | None:
    """Why this DDP's layout cannot be restored, None when it can."""
    import torch.distributed as dist

    hook = _logging_data(ddp).get("comm_hook") or (getattr(ddp, "_comm_hooks", None) and "a Python hook")
    if hook:
        return f"a communication hook ({hook}) lives on DDP's reducer, which a restore replaces"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP-native mixed precision lives on DDP's reducer, which a restore replaces"
    if getattr(ddp, "_use_python_reducer", False):
        return "DDP runs its Python reducer (compiled autograd), whose buckets cannot be set"
    if os.environ.get("DDP_SET_LAST_BUCKET_AS_SMALL"):
        return "$DDP_SET_LAST_BUCKET_AS_SMALL reorders DDP's rebuilt buckets"
    missing = [name for name, owner in (("_build_params_for_reducer", ddp), ("_bucket_config", ddp),
                                        ("_get_ddp_logging_data", ddp), ("Reducer", dist),
                                        ("_rebuild_buckets", getattr(ddp, "reducer", None)))
               if not hasattr(owner, name)]
    if missing:
        return f"this torch's DDP lacks {', '.join(missing)}"
    return None


def _logging_data(ddp: Any) -> dict[str, Any]:
    try:
        return ddp._get_ddp_logging_data()
    except Exception:  # noqa: BLE001 - no logger, or a torch without it
        return {}


def _settle(ddp: Any) -> None:
    """Run a due rebuild now (every rank: it broadcasts rank 0's indices) and let DDP's logger
    record the rebuilt layout, which it otherwise does at its next sampled forward."""
    if _rebuilds(ddp) and ddp.reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True  # as DDP's own forward sets it
    if _rebuilds(ddp) and "rebuilt_per_bucket_param_indices" not in _logging_data(ddp):
        ddp.logger.set_runtime_stats_and_log()


def _record(ddp: Any) -> dict[str, Any]:
    """This DDP's layout as DDP built it (see the module docstring's format)."""
    why = _obstacle(ddp)
    if why is not None:
        return {"restorable": False, "why": why}
    data = _logging_data(ddp)
    indices, sizes = data.get("rebuilt_per_bucket_param_indices"), data.get("rebuilt_bucket_sizes")
    if not _rebuilds(ddp) or not indices and not data.get("has_rebuilt_buckets"):
        return {"restorable": True, "why": None, "rebuilt": False}
    try:
        buckets = [[int(i) for i in bucket.split()] for bucket in indices.split(",")]
        nbytes = [int(size) for size in str(sizes).split(",")]
    except (AttributeError, ValueError):
        return {"restorable": False, "why": f"DDP's logging data names its rebuilt buckets as {indices!r}"}
    return {"restorable": True, "why": None, "rebuilt": True, "params": sum(map(len, buckets)),
            "buckets": buckets, "bucket_bytes": nbytes}


# ---------------------------------------------------------------------- giving it back


def _restore(ddp: Any, record: Mapping[str, Any], name: str) -> bool:
    """Give ``ddp`` the recorded layout when it needs and can take one; True when it got it."""
    if not record.get("restorable") or not record.get("rebuilt") or not _rebuilds(ddp):
        if not record.get("restorable"):
            log.info("%s: DDP's bucket layout was not restorable when saved (%s)", name, record.get("why"))
        return False
    if _world_size(ddp) < _MIN_RANKS:
        return False
    why = _obstacle(ddp)
    if why is None:
        try:
            return _install(ddp, _checked(ddp, record))
        except Exception as exc:  # noqa: BLE001 - a record that does not fit, or internals moved
            why = str(exc)
    log.warning("could not give the resumed DDP %s its recorded gradient buckets (%s); the steps after "
                "this resume may differ in the last bits from an uninterrupted run", name, why)
    return False


def _checked(ddp: Any, record: Mapping[str, Any]) -> list[list[int]]:
    """The recorded buckets, once they are seen to fit this DDP's parameters exactly."""
    parameters, _ = ddp._build_params_for_reducer()
    buckets = [[int(i) for i in bucket] for bucket in record.get("buckets") or []]
    if sorted(i for bucket in buckets for i in bucket) != list(range(len(parameters))):
        raise ValueError(f"the recorded buckets do not cover this model's {len(parameters)} parameters")
    for bucket, nbytes in zip(buckets, record.get("bucket_bytes") or [], strict=True):
        kinds = {(parameters[i].dtype, parameters[i].device) for i in bucket}
        size = sum(parameters[i].numel() * parameters[i].element_size() for i in bucket)
        if len(kinds) != 1 or size != nbytes:
            raise ValueError("the recorded buckets do not fit this model's parameters")
    return buckets


def align_buckets(values: Iterable[Any]) -> int:
    """The old guess, for a checkpoint without a record: give every DDP among ``values`` the
    reversed parameter order cut at DDP's rebuild limits; returns how many were aligned."""
    aligned = 0
    for value in values:
        if is_ddp(value) and _guessable(value):
            try:
                aligned += _install(value, _guess(value))
            except Exception as exc:  # noqa: BLE001 - internals moved: train on, just not bit-exact
                log.warning("could not give the resumed DDP its rebuilt gradient buckets (%s); the first "
                            "step after this resume may differ in the last bits from an uninterrupted run", exc)
    return aligned


def _guessable(ddp: Any) -> bool:
    return _world_size(ddp) >= _MIN_RANKS and _rebuilds(ddp) and _obstacle(ddp) is None


def _limits(ddp: Any) -> tuple[list[int], list[int]]:
    """(DDP's rebuild limits for the C++ reducer, the per-bucket limits those make)."""
    _, rebuild_limits = ddp._bucket_config.compute_bucket_size_limits(
        static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters)
    return rebuild_limits, rebuild_limits or [ddp._bucket_config.first_bucket_bytes_cap, ddp.bucket_bytes_cap]


def _guess(ddp: Any) -> list[list[int]]:
    import torch.distributed as dist

    parameters, expect_sparse = ddp._build_params_for_reducer()
    ready = list(reversed(range(len(parameters))))
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [parameters[i] for i in ready], _limits(ddp)[1], [expect_sparse[i] for i in ready])
    return [[ready[i] for i in bucket] for bucket in buckets]


def _install(ddp: Any, buckets: list[list[int]]) -> bool:
    """Replace ``ddp``'s reducer by one with ``buckets``, as DDP's own constructor builds one."""
    import torch
    import torch.distributed as dist

    parameters, expect_sparse = ddp._build_params_for_reducer()
    rebuild_limits, limits = _limits(ddp)
    sizes = [limits[min(i, len(limits) - 1)] for i in range(len(buckets))]
    reducer = dist.Reducer(
        parameters, buckets, sizes, ddp.process_group, expect_sparse, ddp.bucket_bytes_cap,
        ddp.find_unused_parameters, ddp.gradient_as_bucket_view,
        ddp._build_debug_param_to_name_mapping(parameters), ddp._bucket_config.first_bucket_bytes_cap,
        ddp.skip_all_reduce_unused_params, ddp._use_python_reducer, rebuild_limits, ddp.batched_grad_copy)
    ddp.reducer._remove_autograd_hooks()
    ddp.reducer = reducer
    ddp.logger = dist.Logger(reducer)
    reducer.set_logger(ddp.logger)
    ddp.logger.set_construction_data_and_log(
        ddp.module.__class__.__name__, [] if ddp.device_ids is None else ddp.device_ids,
        -1 if ddp.output_device is None else ddp.output_device, ddp.broadcast_buffers,
        any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules()), ddp.static_graph)
    if ddp.static_graph:
        reducer._set_static_graph()
        ddp.logger._set_static_graph()
    log.debug("resumed DDP: gradient buckets %s", buckets)
    return True
