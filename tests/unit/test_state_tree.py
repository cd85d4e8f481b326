"""Round trips and strict validation of the tagged state tree (ckptless.state.tree)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.errors import ManifestError, StateError
from ckptless.state.tree import MAX_DEPTH, decode, encode

from ..harness.state import assert_identical


def roundtrip(obj: Any) -> Any:
    tree, tensors = encode(obj)
    # Strict JSON (no NaN literals) must accept the tree: it crosses processes as JSON.
    tree = json.loads(json.dumps(tree, allow_nan=False))
    return decode(tree, [t.clone() for t in tensors])


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    t = t.to(dtype)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous
    return t


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    tensors(),
    st.builds(lambda xs: np.asarray(xs, dtype=np.float32), st.lists(st.floats(width=32), max_size=4)),
    st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
    st.builds(np.float64, st.floats()),
    st.builds(np.bool_, st.booleans()),
    st.sampled_from([torch.float32, torch.int64, torch.bfloat16]),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1)]),
    st.builds(torch.Size, st.lists(st.integers(0, 5), max_size=3)),
)

trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=4),
    ),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(trees)
def test_roundtrip_is_exact(obj: Any) -> None:
    assert_identical(obj, roundtrip(obj))


def test_optimizer_like_state_keeps_int_keys_and_tuples() -> None:
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}, 1: {"step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "foreach": None, "amsgrad": False}],
        "last": [float("nan"), float("inf"), -0.0, 10**30],
    }
    back = roundtrip(state)
    assert_identical(state, back)
    assert list(back["state"]) == [0, 1]
    assert isinstance(back["param_groups"][0]["betas"], tuple)


def test_tensors_are_extracted_not_copied() -> None:
    t = torch.arange(6.0)
    tree, ts = encode({"a": t, "b": [t]})
    assert len(ts) == 2 and ts[0].data_ptr() == t.data_ptr()
    assert tree == {"d": [["a", {"T": 0}], ["b", [{"T": 1}]]]}


class Weird:
    pass


@pytest.mark.parametrize(
    ("obj", "path", "what"),
    [
        ({"optimizer": {"state": {0: {"step": Weird()}}}}, "optimizer.state.0.step", "Weird"),
        ({"a": [1, {2, 3}]}, "a.1", "set"),
        ({"a": {1.5: 1}}, "a", "float"),
        ({"a": {(1, 2): 1}}, "a", "tuple"),
        ({"t": torch.zeros(2, dtype=torch.uint32)}, "t", "uint32"),
        ({"n": np.zeros(2, dtype=np.uint32)}, "n", "uint32"),
        ({"n": np.array([object()])}, "n", "object"),
        ({"s": torch.zeros(2).to_sparse()}, "s", "layout"),
        ({"f": lambda: 1}, "f", "function"),
    ],
)
def test_unsupported_values_name_path_and_type(obj: Any, path: str, what: str) -> None:
    with pytest.raises(StateError) as err:
        encode(obj)
    assert path in str(err.value) and what in str(err.value)
    assert not isinstance(err.value, ManifestError)


def test_too_deep_is_rejected() -> None:
    obj: Any = 1
    for _ in range(MAX_DEPTH + 2):
        obj = [obj]
    with pytest.raises(StateError, match="deeper"):
        encode(obj)
    tree: Any = 1
    for _ in range(MAX_DEPTH + 2):
        tree = [tree]
    with pytest.raises(ManifestError):
        decode(tree, [])


@pytest.mark.parametrize(
    "tree",
    [
        {"x": 1},
        {"d": [["a", 1]], "t": []},
        {"T": 1},
        {"T": True},
        {"T": -1},
        {"T": "0"},
        {"Td": [0]},
        {"d": "notalist"},
        {"d": [["a"]]},
        {"d": [[1.5, 1]]},
        {"d": [[True, 1]]},
        {"d": [["a", 1], ["a", 2]]},
        {"t": {"a": 1}},
        {"f": "foo"},
        float("nan"),
        {"S": [-1]},
        {"S": "12"},
        {"dtype": "Tensor"},
        {"dtype": 3},
        {"device": "nonsense:0"},
        {"n": ["object", 1]},
        {"n": ["int8", 1000]},
        {"n": ["int8", "1"]},
        {"N": 5},
        [{"d": [["ok", {"bad": 0}]]}],
    ],
)
def test_malformed_trees_raise_manifest_error(tree: Any) -> None:
    with pytest.raises(ManifestError):
        decode(tree, [torch.zeros(1)])


def test_malformed_error_names_path() -> None:
    with pytest.raises(ManifestError, match=r"model\.w"):
        decode({"d": [["model", {"d": [["w", {"T": 9}]]}]]}, [])
