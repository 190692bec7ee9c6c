"""What a recorded run tells ``spotguard drill`` (spotguard._audit), from real Runs: the progress
marks at each save and after a load (every RNG stream, the LR, the epoch, the loss), the parameters
an optimizer left out of Run trains, and a DDP the job trains through but did not hand to Run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import spotguard
from spotguard._record import read


def _train(root, record, monkeypatch, steps, *, left_out=(), wrap=None):
    """A small job (shuffled ResumableSampler, dropout, AdamW + warm-up LambdaLR) run to ``steps``."""
    monkeypatch.setenv("SPOTGUARD_RECORD", str(record))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    trained = wrap(model) if wrap else model
    optimizer = torch.optim.AdamW(trained.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    sampler = spotguard.ResumableSampler(64, seed=0)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    state = {k: v for k, v in {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                               "sampler": sampler}.items() if k not in left_out}
    with spotguard.Run(root, state=state, daemon=False, save_every=3) as run:
        for _ in run.steps(steps):
            batch = list(sampler)[:4]
            loss = trained(x[batch]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            sampler.advance(4)
    return [e for e in read(record) if e["event"] in ("marks", "unsaved", "ddp")]


def test_marks_at_each_save_and_after_a_load_agree(tmp_path, monkeypatch):
    backward = torch.Tensor.backward
    first = _train(tmp_path / "ckpt", tmp_path / "1.jsonl", monkeypatch, 6)
    assert torch.Tensor.backward is backward  # the loss tap is gone with the Run
    saves = {e["step"]: e for e in first if e["at"] == "save"}
    assert sorted(saves) == [3, 6] and saves[3]["lr"] == [pytest.approx(0.1 * 4 / 10)] and saves[6]["epoch"] == 0
    assert isinstance(saves[6]["loss"], float) and {"python", "torch"} <= set(saves[6]["rng"])
    again = _train(tmp_path / "ckpt", tmp_path / "2.jsonl", monkeypatch, 9)
    (load,) = [e for e in again if e["at"] == "load"]
    assert load["step"] == 6 and "loss" not in load
    assert {k: load[k] for k in ("rng", "lr", "epoch")} == {k: saves[6][k] for k in ("rng", "lr", "epoch")}


def test_an_optimizer_left_out_is_named_with_the_parameters_it_trains(tmp_path, monkeypatch):
    events = _train(tmp_path / "ckpt", tmp_path / "r.jsonl", monkeypatch, 3, left_out=("optimizer",))
    unsaved = [e["what"] for e in events if e["event"] == "unsaved"]
    assert unsaved == ["optimizer (AdamW) training model: 0.weight, 0.bias, 2.weight, 2.bias"]
    (save,) = [e for e in events if e["event"] == "marks"]
    assert save["lr"] == [pytest.approx(0.1 * 4 / 10)]  # read through the scheduler's optimizer


def test_a_ddp_not_handed_to_run_is_recorded(tmp_path, monkeypatch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        events = _train(tmp_path / "ckpt", tmp_path / "r.jsonl", monkeypatch, 2,
                        wrap=nn.parallel.DistributedDataParallel)
    finally:
        dist.destroy_process_group()
    (ddp,) = [e for e in events if e["event"] == "ddp"]
    assert (ddp["entry"], ddp["world_size"]) == ("model", 1)


def test_an_endless_budget_is_recorded_as_none_and_a_framework_budget_instead(tmp_path):
    """The Lightning callback drives Run's loop with an endless budget (2**62, past the schema's
    bound: the drill refused the start line) and records the trainer's max_steps instead."""
    from spotguard._record import Recorder

    record = Recorder(tmp_path / "r.jsonl")
    record.start(root=tmp_path, world_size=1, resumed_from=None, skipped=[], total=2**62)
    record.total = 60
    record.start(root=tmp_path, world_size=1, resumed_from=None, skipped=[], total=2**62)
    problems: list[str] = []
    assert [e["total"] for e in read(tmp_path / "r.jsonl", problems)] == [None, 60] and not problems


def test_parameters_trained_but_held_by_no_model_in_run_are_named(tmp_path, monkeypatch):
    """A head trained by the saved optimizer but left out of Run: its weights would start over."""
    monkeypatch.setenv("SPOTGUARD_RECORD", str(tmp_path / "r.jsonl"))
    body, head = nn.Linear(4, 3), nn.Linear(3, 1)
    optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
    with spotguard.Run(tmp_path / "ckpt", model=body, optimizer=optimizer, daemon=False) as run:
        for _ in run.steps(2):
            head(body(torch.ones(2, 4))).sum().backward()
            optimizer.step()
    unsaved = [e["what"] for e in read(tmp_path / "r.jsonl") if e["event"] == "unsaved"]
    assert unsaved == ["2 parameter tensor(s) the optimizer (SGD) trains but no model in Run holds "
                       "(shapes [1, 3], [1])"]
