"""CUDA code paths: per-device RNG state, pinned staging buffers, CUDA tensors through save and load.

Skipped where no GPU is present (CI has none); run on a GPU machine with
``python -m pytest tests/gpu`` (see benchmarks/README.md for the last run's output).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    return model, optimizer, scaler


def _train(model, optimizer, scaler, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(32, 64, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(torch.nn.functional.dropout(x, 0.1)).float().pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def test_cuda_rng_state_round_trips_for_every_device():
    from spotguard import rng

    state = rng.capture()
    assert state["cuda_devices"] == torch.cuda.device_count() and state["cuda"] is not None
    first = [torch.rand(4, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    rng.restore(state)
    again = [torch.rand(4, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_staging_buffers_are_pinned_and_reused_across_saves(tmp_path):
    from spotguard.checkpoint import Checkpointer

    model, optimizer, scaler = _model_and_optimizer(0)
    _train(model, optimizer, scaler, 2)
    ckpt = Checkpointer(tmp_path)
    state = {"model": model, "optimizer": optimizer, "scaler": scaler}
    ckpt.save(1, state)
    ckpt.wait()
    buffers = list(ckpt._stager._buffers)
    assert buffers and all(b.is_pinned() for b in buffers)
    ckpt.save(2, state)
    ckpt.wait()
    assert [b.data_ptr() for b in ckpt._stager._buffers] == [b.data_ptr() for b in buffers]
    ckpt.close()


def test_cuda_training_resumes_bit_identical(tmp_path):
    from spotguard import rng
    from spotguard.checkpoint import Checkpointer

    torch.backends.cudnn.deterministic = True
    reference = _model_and_optimizer(0)
    _train(*reference, 6)

    model, optimizer, scaler = _model_and_optimizer(0)
    _train(model, optimizer, scaler, 3)
    saver = Checkpointer(tmp_path)
    saver.save(3, {"model": model, "optimizer": optimizer, "scaler": scaler, "rng": _Rng(rng)})
    saver.close()

    resumed = _model_and_optimizer(1)  # different initial weights: everything must come from disk
    loader = Checkpointer(tmp_path)
    info = loader.load_latest({"model": resumed[0], "optimizer": resumed[1], "scaler": resumed[2],
                               "rng": _Rng(rng)})
    assert info is not None and info.step == 3
    assert next(resumed[0].parameters()).is_cuda
    _train(*resumed, 3)
    for a, b in zip(reference[0].state_dict().values(), resumed[0].state_dict().values()):
        assert torch.equal(a, b)
    assert reference[2].get_scale() == resumed[2].get_scale()


class _Rng:
    def __init__(self, module) -> None:
        self.module = module

    def state_dict(self):
        return self.module.capture()

    def load_state_dict(self, state) -> None:
        self.module.restore(state)
