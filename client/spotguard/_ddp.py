"""Exact resume for ``DistributedDataParallel`` with three or more ranks.

DDP all-reduces gradients bucket by bucket. A new DDP's first iteration uses one bucket in parameter
order; after it, DDP rebuilds its buckets in the order the gradients became ready (reversed
parameter order for a model without control flow). A relaunched process's first step would
therefore all-reduce another layout than the uninterrupted run's same step did, and with three or
more ranks the ring all-reduce then adds each element in another order: the last bits differ and
the runs drift apart. (Two ranks are unaffected: a sum of two is the same either way.)

:func:`align_buckets` gives a resumed DDP, before its first step, the buckets DDP would have rebuilt:
the reversed parameter order cut at DDP's rebuild limits. Where that guess is wrong (a model whose
backward readies gradients in another order) the first step is as before, and DDP rebuilds after it.

This uses DDP internals (``_build_params_for_reducer``, ``dist.Reducer``); anything unexpected
leaves the DDP as it was, logged, never a failed start. Skipped where it cannot apply: fewer than
three ranks, ``find_unused_parameters`` without ``static_graph`` (DDP never rebuilds then), a comm
hook or mixed precision (they live on the reducer), the Python reducer, ``DDP_SET_LAST_BUCKET_AS_SMALL``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

log = logging.getLogger(__name__)

__all__ = ["align_buckets"]


def align_buckets(values: Iterable[Any]) -> int:
    """Align every DDP among ``values`` (a Run's state); returns how many were aligned."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # torch without distributed
        return 0
    aligned = 0
    for value in values:
        if isinstance(value, DistributedDataParallel) and _applies(value):
            try:
                _rebuild_reducer(value)
                aligned += 1
            except Exception as exc:  # noqa: BLE001 - internals moved: train on, just not bit-exact
                log.warning("could not give the resumed DDP its rebuilt gradient buckets (%s); the first "
                            "step after this resume may differ in the last bits from an uninterrupted run", exc)
    return aligned


def _applies(ddp: Any) -> bool:
    import torch.distributed as dist

    return (dist.get_world_size(ddp.process_group) >= 3
            and (ddp.static_graph or not ddp.find_unused_parameters)
            and not getattr(ddp, "_comm_hooks", None) and getattr(ddp, "mixed_precision", None) is None
            and not getattr(ddp, "_use_python_reducer", False)
            and not os.environ.get("DDP_SET_LAST_BUCKET_AS_SMALL"))


def _rebuild_reducer(ddp: Any) -> None:
    """Replace ``ddp``'s reducer by one whose buckets are those DDP's rebuild would make."""
    import torch.distributed as dist

    parameters, expect_sparse = ddp._build_params_for_reducer()
    _, rebuild_limits = ddp._bucket_config.compute_bucket_size_limits(
        static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters)
    limits = rebuild_limits or [ddp._bucket_config.first_bucket_bytes_cap, ddp.bucket_bytes_cap]
    ready = list(reversed(range(len(parameters))))
    buckets, sizes = dist._compute_bucket_assignment_by_size(
        [parameters[i] for i in ready], limits, [expect_sparse[i] for i in ready])
    buckets = [[ready[i] for i in bucket] for bucket in buckets]
    reducer = dist.Reducer(
        parameters, buckets, sizes, ddp.process_group, expect_sparse, ddp.bucket_bytes_cap,
        ddp.find_unused_parameters, ddp.gradient_as_bucket_view,
        ddp._build_debug_param_to_name_mapping(parameters), ddp._bucket_config.first_bucket_bytes_cap,
        ddp.skip_all_reduce_unused_params, ddp._use_python_reducer, rebuild_limits, ddp.batched_grad_copy)
    ddp.reducer._remove_autograd_hooks()
    ddp.reducer = reducer
    ddp.logger = dist.Logger(reducer)
    reducer.set_logger(ddp.logger)
    if ddp.static_graph:
        reducer._set_static_graph()
    log.debug("resumed DDP: gradient buckets %s", buckets)
