"""spotguard.rng: capture, draw, restore, draw again gives the same numbers, for every generator."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from spotguard import rng


def _draw() -> tuple:
    """A few numbers from every generator (the gauss pair caches are exercised on purpose)."""
    cuda = [torch.rand(3, device=f"cuda:{d}").tolist() for d in range(torch.cuda.device_count())]
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [float(np.random.standard_normal())],
        torch.rand(3).tolist() + torch.randn(1).tolist(),
        cuda,
    )


def _split(state: dict) -> tuple[dict, dict]:
    """The JSON-able part and the tensor part of a captured state."""
    tensors = {k: state[k] for k in ("torch", "cuda")}
    return {k: v for k, v in state.items() if k not in tensors}, tensors


def _leaf_types(value) -> set[type]:
    if isinstance(value, dict):
        assert all(isinstance(k, str) for k in value)
        return set().union(*map(_leaf_types, value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*map(_leaf_types, value)) if value else set()
    return {type(value)}


def test_capture_draw_restore_draw_is_identical():
    random.gauss(0, 1), np.random.standard_normal(), torch.randn(1)  # fill the gauss caches
    state = rng.capture()
    first = _draw()
    rng.restore(state)
    assert _draw() == first


def test_capture_changes_no_generator():
    state = rng.capture()
    first = _draw()
    rng.restore(state)
    rng.capture()
    assert _draw() == first


def test_state_holds_only_plain_values_and_uint8_tensors():
    state = rng.capture()
    plain, tensors = _split(state)
    assert _leaf_types(plain) <= {int, float, str, bool, type(None)}
    assert tensors["torch"].dtype == torch.uint8
    assert state["format"] == rng.FORMAT
    assert len(state["python"]["state"]) == 625 and len(state["numpy"]["keys"]) == 624


def test_json_round_trip_of_the_plain_part_restores_python_and_numpy():
    plain, tensors = _split(rng.capture())
    first = _draw()
    loaded = json.loads(json.dumps(plain))
    rng.restore({**loaded, **tensors})
    assert _draw() == first


def test_torch_save_load_weights_only_round_trip():
    buffer = io.BytesIO()
    torch.save(rng.capture(), buffer)
    first = _draw()
    buffer.seek(0)
    rng.restore(torch.load(buffer, weights_only=True))
    assert _draw() == first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")
def test_without_cuda_records_that_no_cuda_state_was_captured():
    state = rng.capture()
    assert state["cuda"] is None
    assert state["cuda_devices"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")
def test_cuda_states_on_a_machine_without_cuda_restore_the_rest_and_warn():
    state = rng.capture()
    foreign = {**state, "cuda": [torch.zeros(16, dtype=torch.uint8)] * 2, "cuda_devices": 2}
    first = _draw()
    with pytest.warns(rng.RngRestoreWarning, match="2 devices, this machine has 0"):
        rng.restore(foreign)
    assert _draw()[:3] == first[:3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_states_are_captured_per_device_and_restored():
    state = rng.capture()
    assert state["cuda_devices"] == torch.cuda.device_count() == len(state["cuda"])
    first = _draw()
    rng.restore(state)
    assert _draw() == first
    extra = {**state, "cuda": state["cuda"] * 2 + [state["cuda"][0]]}
    with pytest.warns(rng.RngRestoreWarning, match="skipped"):
        rng.restore(extra)


@pytest.mark.parametrize(
    "broken",
    [
        None,
        {"format": 99},
        {"format": rng.FORMAT, "python": {"version": 3}},
        {"format": rng.FORMAT, "python": {"version": 3, "state": ["x"], "gauss_next": None}},
        "torch-part",
        "numpy-part",
    ],
)
def test_malformed_state_raises_and_changes_nothing(broken):
    good = rng.capture()
    if broken == "torch-part":
        broken = {**good, "torch": [1, 2, 3]}
    elif broken == "numpy-part":
        broken = {**good, "numpy": {"algorithm": "MT19937"}}
    random.random(), np.random.rand(), torch.rand(1)
    before = rng.capture()
    expected = _draw()
    rng.restore(before)
    with pytest.raises(rng.RngStateError):
        rng.restore(broken)
    assert _draw() == expected


def test_works_in_a_process_that_never_imported_torch_or_numpy(tmp_path):
    script = textwrap.dedent(
        """
        import json, random, sys
        from spotguard import rng
        state = rng.capture()
        first = [random.random() for _ in range(3)]
        rng.restore(json.loads(json.dumps(state)))
        again = [random.random() for _ in range(3)]
        print(json.dumps({"same": first == again, "torch": state["torch"], "numpy": state["numpy"],
                          "cuda": state["cuda"], "loaded": "torch" in sys.modules
                          or "numpy" in sys.modules}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=tmp_path, timeout=60)
    result = json.loads(out.stdout)
    assert result == {"same": True, "torch": None, "numpy": None, "cuda": None, "loaded": False}


def test_restores_from_a_view_into_a_larger_buffer(tmp_path):
    """Checkpoint loaders hand back views into one buffer; set_rng_state needs its own storage.

    Run in a child so a regression crashes the child, not the test session.
    """
    script = textwrap.dedent(
        """
        import torch
        from spotguard import rng
        state = rng.capture()
        first = torch.rand(4).tolist()
        cpu = state["torch"]
        buffer = torch.zeros(cpu.numel() + 64, dtype=torch.uint8)
        buffer[32:32 + cpu.numel()] = cpu
        rng.restore({**state, "torch": buffer[32:32 + cpu.numel()]})
        assert torch.rand(4).tolist() == first
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=60)
