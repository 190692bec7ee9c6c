"""DDP with four real gloo ranks: a DDP built anew mid-run (as a relaunch builds it) all-reduces its
first step in another bucket layout unless spotguard._ddp aligns it, and then sums differ in the last
bits. With the alignment the step is bit-identical to the uninterrupted run's.

The multi-node end-to-end proof is tests/multinode/test_multinode_notice.py; this one shows the
mechanism in seconds, and that every case the alignment must skip is skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from spotguard import _ddp

pytestmark = pytest.mark.timeout(120)
RANKS, RESUME_AT = 4, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 1))


def _grads_at_resume(rank: int, relaunch: bool, align: bool) -> torch.Tensor:
    """Train RESUME_AT steps; with ``relaunch`` the last one runs on a DDP built anew (a relaunched
    process's first step); returns that step's all-reduced gradients."""
    inner = _model()
    ddp = nn.parallel.DistributedDataParallel(inner)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1, RESUME_AT + 1):
        if relaunch and step == RESUME_AT:
            ddp = nn.parallel.DistributedDataParallel(inner)
            if align:
                assert _ddp.align_buckets([ddp, object()]) == 1
        x = torch.randn(16, 8, generator=g)
        for p in ddp.parameters():
            p.grad = None
        ddp(x).pow(2).sum().backward()
        with torch.no_grad():
            for p in ddp.parameters():
                p -= 0.01 * p.grad
    return torch.cat([p.grad.flatten() for p in ddp.parameters()])


def _worker(rank: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    torch.set_num_threads(1)
    try:
        uninterrupted = _grads_at_resume(rank, relaunch=False, align=False)
        plain = _grads_at_resume(rank, relaunch=True, align=False)
        aligned = _grads_at_resume(rank, relaunch=True, align=True)
        skipped = _must_not_touch(rank)
        if rank == 0:
            out["plain"] = int((plain != uninterrupted).sum())
            out["aligned"] = int((aligned != uninterrupted).sum())
            out["skipped"] = skipped
    finally:
        dist.destroy_process_group()


def test_a_relaunched_ddp_all_reduces_its_first_step_bit_identically_once_aligned(tmp_path):
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_worker, args=(f"file://{tmp_path}/init", shared), nprocs=RANKS, join=True)
        out = dict(shared)
    assert out["plain"] > 0, "a new DDP summed exactly as the rebuilt one: the test proves nothing"
    assert out["aligned"] == 0, out
    assert out["skipped"] == [0, 0, 0]  # a comm hook, find_unused_parameters, two ranks: left alone


def _must_not_touch(rank: int) -> list[int]:
    """A comm hook lives on the reducer; find_unused_parameters never rebuilds; two ranks sum exactly."""
    hooked = nn.parallel.DistributedDataParallel(_model())
    hooked.register_comm_hook(None, lambda _, bucket: _allreduce(bucket))
    unused = nn.parallel.DistributedDataParallel(_model(), find_unused_parameters=True)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    pair = nn.parallel.DistributedDataParallel(_model(), process_group=pairs[rank // 2])
    return [_ddp.align_buckets([m]) for m in (hooked, unused, pair)]


def _allreduce(bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def test_nothing_but_ddp_is_touched():
    assert _ddp.align_buckets([nn.Linear(2, 2), {"a": 1}, None]) == 0
