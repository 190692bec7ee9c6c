"""DDP with real gloo ranks: a DDP built anew mid-run (as a relaunch builds it) all-reduces its next
steps in another bucket layout unless spotguard._ddp gives it the one the uninterrupted DDP used, and
then sums differ in the last bits.

Four ranks: the old guess (reversed parameter order, still used for a checkpoint without a record)
aligns a plain MLP, and every case it must skip is skipped. Three ranks, bf16 autocast: the layout
recorded at a save (:class:`spotguard._ddp.Layouts`) restores the steps bit for bit where the guess
does not; a comm hook's layout is recorded as unrestorable and warned about once. The end-to-end
proofs are tests/client/test_ddp_layout.py (torchrun, Run, Lightning, HF) and tests/multinode/.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _ddp_layout_job import BUCKET_MB, Residual
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
        _quiesce()
    finally:
        dist.destroy_process_group()


def _quiesce() -> None:
    """Before the process group goes: the DDPs made here (a comm hook's Python future among them)
    are freed while the interpreter is whole, and no rank closes its connections while another is
    still in a collective. Without this a rank aborted in gloo's teardown ("terminate called
    without an active exception", SIGABRT) once in a CI run."""
    gc.collect()
    dist.barrier()


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


# ---------------------------------------------------------------------- the recorded layout


LAYOUT_RANKS = 3


def _residual() -> nn.Module:
    """Residual LayerNorm/Linear blocks (the torchrun job's): under bf16 autocast each weight's
    gradient is ready before its bias, so DDP's rebuilt layout is not the reversed parameter order."""
    torch.manual_seed(0)
    return Residual()


def _ddp_of(model: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)


def _steps(ddp: nn.Module, first: int, last: int) -> torch.Tensor:
    """Steps ``first``..``last`` under bf16 autocast; then the weights and all-reduced gradients."""
    for step in range(first, last + 1):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        for p in ddp.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ddp(x)
        out.float().pow(2).sum().backward()
        with torch.no_grad():
            for p in ddp.parameters():
                p -= 0.01 * p.grad
    return torch.cat([t.flatten() for p in ddp.parameters() for t in (p, p.grad)])


def _relaunched(weights: dict, record: dict | None, guess: bool = False) -> torch.Tensor:
    """A relaunch's DDP built anew from the checkpoint's weights, its layout restored from
    ``record`` (or guessed), trained through step 3."""
    model = _residual()
    model.load_state_dict(weights)
    ddp = _ddp_of(model)
    layouts = _ddp.Layouts({"model": ddp})
    layouts.load_state_dict(record)
    assert (_ddp.align_buckets([ddp]) if guess else layouts.restore()) == 1
    return _steps(ddp, 2, 3)


def _layout_worker(rank: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=LAYOUT_RANKS)
    torch.set_num_threads(1)
    try:
        model = _residual()
        ddp = _ddp_of(model)
        _steps(ddp, 0, 1)  # saved after step 1: DDP's rebuild is due, not done (settle does it)
        record = _save(_ddp.Layouts({"model": ddp}))
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        uninterrupted = _steps(ddp, 2, 3)
        restored = _relaunched(weights, record)
        guessed = _relaunched(weights, record, guess=True)
        others = _not_restorable_records()
        if rank == 0:
            out.update(record=record, restored=int((restored != uninterrupted).sum()),
                       guessed=int((guessed != uninterrupted).sum()), guess=_ddp._guess(ddp), **others)
        _quiesce()
    finally:
        dist.destroy_process_group()


def _not_restorable_records() -> dict:
    hooked = _ddp_of(_residual())
    hooked.register_comm_hook(None, lambda _, bucket: _allreduce(bucket))
    unused = nn.parallel.DistributedDataParallel(_residual(), find_unused_parameters=True)
    _steps(hooked, 0, 2)
    _steps(unused, 0, 2)
    hooked_layouts, warned = _ddp.Layouts({"model": hooked}), []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger(_ddp.__name__).addHandler(handler)
    saves = [_save(hooked_layouts), _save(hooked_layouts)]  # two saves: one warning (rank 0)
    return {"hooked": saves, "warned": warned, "unused": _ddp.Layouts({"model": unused}).state_dict()}


def _save(layouts: _ddp.Layouts) -> dict:
    """What a save does with the layouts: settle on every rank, then the record."""
    layouts.settle()
    return layouts.state_dict()


def test_the_recorded_layout_resumes_bit_identically_where_the_old_guess_does_not(tmp_path):
    """Saved after step 1 (DDP's rebuild due, not done), relaunched: the recorded layout gives the
    next steps' gradients bit for bit, the reversed-order guess does not. A comm hook makes the
    layout unrestorable (recorded with why, warned once); find_unused_parameters never rebuilds."""
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_layout_worker, args=(f"file://{tmp_path}/init", shared), nprocs=LAYOUT_RANKS, join=True)
        out = dict(shared)
    record = out["record"]
    assert record["restorable"] and record["why"] is None and record["world_size"] == LAYOUT_RANKS
    model = record["ddps"]["model"]
    assert model["rebuilt"] and model["params"] == len(list(_residual().parameters()))
    assert model["buckets"] != out["guess"]  # under autocast: weight before bias
    assert out["restored"] == 0
    assert out["guessed"] > 0, "the reversed-order guess summed exactly: the test proves nothing"
    first, second = out["hooked"]
    assert first == second and not first["restorable"] and "communication hook" in first["why"]
    assert first["ddps"]["model"] == {"restorable": False, "why": first["why"].removeprefix("model: ")}
    assert len(out["warned"]) == 1 and "communication hook" in out["warned"][0], out["warned"]
    assert out["unused"]["restorable"] and out["unused"]["ddps"]["model"]["rebuilt"] is False

