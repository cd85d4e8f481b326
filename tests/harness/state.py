"""Exact comparison of training state for the state-package tests: no tolerance anywhere."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "", *, strict: bool = False) -> None:
    """Equal types and values; tensors by dtype, shape and bits. ``strict`` also compares NumPy arrays and
    scalars, and floats by bits (nan equals nan, -0.0 is not 0.0), and requires equal dict key types."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif strict and isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
    elif strict and isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    elif strict and isinstance(a, np.generic):
        assert a.dtype == b.dtype and (a == b or (np.isnan(a) and np.isnan(b))), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            if strict:
                assert type(ka) is type(kb), f"{path}: key {ka!r}"
            assert_same(va, vb, f"{path}.{ka}", strict=strict)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}", strict=strict)
    else:
        assert a == b, path


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Exact equality including Python types, nan, -0.0, tensor and array dtype/shape (``strict``)."""
    assert_same(a, b, path, strict=True)


def assert_log_and_registry_equal(a: Any, b: Any) -> None:
    """Two trainers logged the same draws and losses, and every protected object has the same state."""
    assert_same(a.log, b.log, "log")
    for name, obj in a.registry.items():
        assert_same(obj.state_dict(), b.registry[name].state_dict(), name)
