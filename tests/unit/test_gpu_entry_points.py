"""``make test-gpu`` and ``bench/gpu.py`` on a machine without CUDA: they skip cleanly (exit 0).

(The GPU tests themselves are collected by ``make test`` too, and skipped by tests/gpu/conftest.py.)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine-without-CUDA behaviour")
def test_bench_gpu_says_it_has_nothing_to_measure_and_exits_0(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["bench/gpu.py", "--sizes", "1"])
    assert mod.main() == 0
    assert "no CUDA device here" in capsys.readouterr().out
