"""The pickle-free tree encoding: every supported value round-trips with its exact type."""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spotguard.checkpoint import Checkpointer, UnsupportedStateError
from spotguard.checkpoint.format import decode, encode


def roundtrip(obj):
    tensors: list[torch.Tensor] = []
    encoded = json.loads(json.dumps(encode(obj, tensors), allow_nan=False))
    return decode(encoded, lambda i: tensors[i].clone())


def assert_identical(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8) if a.dtype.itemsize == 1 else b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for (ka, va), kb in zip(a.items(), b.keys()):
            assert type(ka) is type(kb)
            assert_identical(va, b[kb])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_nested_containers_keep_types_and_int_keys():
    obj = OrderedDict(
        state={0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}, 1: {}},
        param_groups=[{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "foreign": None, "flag": True}],
        odd={(1, "a"): b"\x00\xff", 2.5: float("nan"), "inf": float("-inf"), "dt": torch.bfloat16},
        size=torch.Size([2, 3]),
        device=torch.device("cpu"),
    )
    assert_identical(obj, roundtrip(obj))


def test_python_and_numpy_rng_states_roundtrip():
    np_state = np.random.RandomState(7).get_state()
    obj = {"py": random.Random(3).getstate(), "np": np_state, "scalar": np.float64(1.5), "gen": np.random.default_rng(1).bit_generator.state}
    back = roundtrip(obj)
    assert_identical(obj, back)
    r = np.random.RandomState()
    r.set_state(back["np"])
    assert r.randint(0, 1 << 30) == np.random.RandomState(7).randint(0, 1 << 30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.uint8, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_tensor_dtypes_roundtrip_bit_exact(tmp_path, dtype):
    src = torch.randn(5, 7).to(dtype) if dtype.is_floating_point or dtype.is_complex else torch.randint(0, 2, (5, 7)).to(dtype)
    big = torch.randn(600, 600).to(dtype) if dtype.is_floating_point else torch.zeros(600, 600, dtype=dtype)
    state = {"x": {"small": src, "big": big, "nc": big.t()[::2], "scalar": src[0, 0]}}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state, blocking=True)
        target: dict = {}
        assert ck.load_latest({"x": target}).step == 1
    for key, value in state["x"].items():
        got = target[key]
        assert got.dtype == dtype and got.shape == value.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8))


def test_unsupported_values_are_named(tmp_path):
    class Opaque:
        pass

    with Checkpointer(tmp_path) as ck, pytest.raises(UnsupportedStateError, match=r"extra\['bad'\]"):
        ck.save(1, {"extra": {"bad": Opaque()}})
    with pytest.raises(UnsupportedStateError, match="object"):
        roundtrip(np.array([object()], dtype=object))


leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5),
                   st.binary(max_size=5))
trees = st.recursive(
    leaves,
    lambda c: st.one_of(st.lists(c, max_size=4), st.tuples(c, c),
                        st.dictionaries(st.one_of(st.integers(), st.text(max_size=3)), c, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_any_plain_tree_roundtrips(tree):
    assert_identical(tree, roundtrip(tree))
