"""The emergency path with CUDA tensors: streamed device-to-host through pinned chunks on a side
stream, the same files and state digest as a periodic save, and the chunks reused by later saves.

Skipped where no GPU is present (CI has none); run on a GPU machine with
``python -m pytest tests/gpu``.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 8)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    extras = {"odd": torch.randn(1_000_003, device="cuda"), "half": torch.randn(300_000, device="cuda").bfloat16(),
              "strided": torch.randn(500, 700, device="cuda").t(), "cpu": torch.randn(100_000)}
    return {"model": model, "optimizer": opt, "extras": extras}


def test_cuda_state_streams_through_pinned_chunks_same_files_as_periodic(tmp_path, monkeypatch):
    from spotguard.checkpoint import Checkpointer, emergency

    monkeypatch.setattr(emergency, "STREAM_CHUNK_BYTES", 1 << 20)  # several chunks per tensor
    state = cuda_state()
    with Checkpointer(tmp_path / "e", large_tensor_bytes=4096) as ck:
        ck.save(1, state, blocking=True)
        chunks = list(ck.emergency._chunks.get() for _ in range(ck.emergency._allocated))
        assert chunks and all(c.is_pinned() for pair in chunks for c in pair)
        for pair in chunks:
            ck.emergency.give_chunks(pair)
        allocated = ck.emergency._allocated
        ck.save(2, state, blocking=True)
        assert ck.emergency._allocated == allocated  # reused, not allocated again
    with Checkpointer(tmp_path / "p", large_tensor_bytes=4096) as ck:
        ck.save(1, state)
    live = json.loads((tmp_path / "e/step-0000000001/manifest.json").read_text())
    staged = json.loads((tmp_path / "p/step-0000000001/manifest.json").read_text())
    assert live["files"] == staged["files"] and live["digest"] == staged["digest"]
    target = cuda_state()
    for t in target["extras"].values():
        t.zero_()
    assert Checkpointer(tmp_path / "e").load_latest(target).step == 2
    assert all(torch.equal(target["extras"][k], v) for k, v in state["extras"].items())
