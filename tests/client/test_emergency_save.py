"""The emergency path (``save(blocking=True)``): written from live memory, same files and digests
as a periodic save, the pipeline that streams CUDA tensors (run here on CPU sources), the save in
flight it waits for, and the bandwidth it measures for the deadline decision."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

import pytest
import torch

from spotguard.checkpoint import Checkpointer, _fs, emergency
from spotguard.checkpoint.emergency import ASSUMED_THROUGHPUT, stream_tensor


def training_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    extras = {"big": torch.randn(300_001), "half": torch.randn(70_000).to(torch.bfloat16),
              "strided": torch.randn(600, 700).t(), "empty": torch.zeros(0), "n": 3}
    return {"model": model, "optimizer": opt, "extras": extras}


def manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_same_files_and_digest_as_a_periodic_save_and_no_staging_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(emergency, "SEGMENT_BYTES", 100_000)  # big tensors span several threads
    state = training_state()
    with Checkpointer(tmp_path / "e", large_tensor_bytes=4096) as ck:
        ck.save(1, state, blocking=True)
        assert ck._stager._buffers == []  # written from the state's own memory
    with Checkpointer(tmp_path / "p", large_tensor_bytes=4096) as ck:
        ck.save(1, state)
    live, staged = manifest(tmp_path / "e/step-0000000001"), manifest(tmp_path / "p/step-0000000001")
    assert live["files"] == staged["files"] and live["digest"] == staged["digest"]
    assert sum("/tensors/" in rel for rel in live["files"]) >= 5
    fresh = training_state()
    fresh["extras"] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in fresh["extras"].items()}
    with Checkpointer(tmp_path / "e") as ck:  # verified on load (sha256 of every file)
        assert ck.load_latest(fresh).step == 1
    assert all(torch.equal(fresh["extras"][k], v) for k, v in state["extras"].items() if k != "n")
    assert fresh["extras"]["n"] == 3


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 5 * 6000])
def test_stream_pipeline_writes_every_byte_through_two_chunks(tmp_path, monkeypatch, nbytes):
    monkeypatch.setattr(_fs, "CHUNK_BYTES", 6000)  # XXH3 chunks across the stream's 4096-byte chunks
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        digests = stream_tensor(fd, src, [torch.empty(4096, dtype=torch.uint8) for _ in range(2)])
    finally:
        os.close(fd)
    data = (tmp_path / "f").read_bytes()
    assert data == src.numpy().tobytes() and digests["sha256"] == hashlib.sha256(data).hexdigest()
    assert digests == _fs.digests_of(data)  # the entry a periodic save writes: a restore checks its XXH3s
    assert len(digests["xxh3"]) == -(-nbytes // 6000)


def test_stream_pipeline_takes_any_dtype_and_layout(tmp_path):
    src = torch.randn(97, 33).to(torch.bfloat16).t()  # not contiguous
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        stream_tensor(fd, src, [torch.empty(1000, dtype=torch.uint8) for _ in range(2)])
    finally:
        os.close(fd)
    back = torch.frombuffer(bytearray((tmp_path / "f").read_bytes()), dtype=torch.bfloat16).view(33, 97)
    assert torch.equal(back, src)


def test_waits_for_the_save_in_flight_and_commits_the_newest(tmp_path):
    with Checkpointer(tmp_path, background_cpu_share=0.05) as ck:
        ck.save(1, {"t": torch.randn(1 << 20)})
        ck.save(2, {"t": torch.full((1 << 20,), 2.0)}, blocking=True)  # lifts step 1's cap, then saves
        assert not ck.in_flight and ck.wait().step == 2
        assert (tmp_path / "step-0000000001").is_dir()
    target = {"t": torch.zeros(1 << 20)}
    assert Checkpointer(tmp_path).load_latest(target).step == 2 and target["t"][0] == 2


def test_a_failed_save_in_flight_does_not_stop_the_emergency_save(tmp_path, caplog):
    ck = Checkpointer(tmp_path)
    ck.save(1, {"t": torch.ones(2)}, blocking=True)
    (tmp_path / f".tmp-step-0000000002-{os.getpid()}").write_text("in the way")
    ck.save(2, {"t": torch.full((2,), 2.0)})  # fails in the background
    with caplog.at_level(logging.ERROR, logger="spotguard.checkpoint"):
        ck.save(3, {"t": torch.full((2,), 3.0)}, blocking=True)
    assert any("emergency save goes on" in r.getMessage() for r in caplog.records)
    assert ck.wait().step == 3
    ck.close()


def test_estimate_assumed_then_seeded_by_periodic_then_measured_by_emergency(tmp_path):
    n = 1 << 20
    with Checkpointer(tmp_path) as ck:
        assert ck.emergency_seconds(10**8) == pytest.approx(10**8 / ASSUMED_THROUGHPUT)
        ck.save(1, {"t": torch.randn(n // 4)})
        ck.wait()
        assert ck.emergency_seconds(n) == pytest.approx(ck.stats.persist_seconds)  # seeded
        ck.save(2, {"t": torch.randn(n // 4)}, blocking=True)
        measured = ck.emergency.bandwidth
        assert ck.emergency.measured and ck.emergency_seconds(n) == pytest.approx(n / measured)
        ck.save(3, {"t": torch.randn(n // 4)})
        ck.wait()
        assert ck.emergency.bandwidth == measured  # periodic saves no longer move it


def test_estimate_counts_the_save_in_flight_the_emergency_save_must_wait_for(tmp_path):
    release = threading.Event()
    ck = Checkpointer(tmp_path, on_commit=lambda info: release.wait(10))
    ck.emergency.observe(10**6, 1.0)  # as if an emergency save had run at 1 MB/s
    ck.save(1, {"t": torch.zeros(250_000)})  # 1 MB, held in flight by the callback
    try:
        assert ck.in_flight and ck.emergency_seconds(2 * 10**6) == pytest.approx(3.0)
    finally:
        release.set()
    ck.wait()
    assert ck.emergency_seconds(2 * 10**6) == pytest.approx(2.0)
    ck.close()
