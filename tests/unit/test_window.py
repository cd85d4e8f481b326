"""Which versions are protected around a gradient-accumulation window (ckptless/state/window.py, issue 38).

The pure rule (``decide``) under hypothesis: a protected version is never inside a window (unless it
is the run's last), a due version skipped inside a window is protected at the next clean boundary,
and nothing is protected that was not due. The tracker (``GradientWindow``) on real optimizers: a
loop accumulating by hand (``zero_grad`` to None or to zeros, or at the window's start), several
optimizers, an eval batch, Accelerate's ``AcceleratedOptimizer`` whose micro-batch steps are skipped,
a wrapper that takes no hook; ``clear_grads`` after a restore.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptless.state.window import GradientWindow, clear_grads, decide


def _protected(cleans: list[bool], every: int) -> list[int]:
    """The versions 1..n the rule protects for a run whose boundary i is clean when cleans[i-1]."""
    owed, out = False, []
    n = len(cleans)
    for v, c in enumerate(cleans, start=1):
        now, owed = decide(v % every == 0, c, owed, final=v == n)
        if now:
            out.append(v)
    return out


@given(st.lists(st.booleans(), min_size=1, max_size=60), st.integers(1, 5))
def test_protected_versions_are_clean_and_every_due_one_is_made_up_at_the_next_clean_one(
        cleans: list[bool], every: int) -> None:
    n = len(cleans)
    got = _protected(cleans, every)
    assert got and got[-1] == n  # the run's last version, always
    assert all(cleans[v - 1] for v in got if v != n)  # never inside a window (but the last)
    for due in range(every, n + 1, every):  # each due version, or the next clean one, is protected
        nxt = next((v for v in range(due, n + 1) if cleans[v - 1]), n)
        assert nxt in got, (due, got)
    for v in got[:-1]:  # and nothing else: a protected version was due, or owed since the last one
        before = [p for p in got if p < v]
        assert v % every == 0 or any(d % every == 0 for d in range((before[-1] if before else 0) + 1, v))


def test_without_windows_the_period_is_unchanged() -> None:
    assert _protected([True] * 12, 3) == [3, 6, 9, 12]
    assert _protected([True] * 11, 1) == list(range(1, 12))


def test_a_window_of_4_protects_its_boundaries_only() -> None:
    cleans = [(v % 4 == 0) for v in range(1, 14)]  # boundary v clean after the window's step
    assert _protected(cleans, 1) == [4, 8, 12, 13]  # 13: the run's last version
    assert _protected(cleans, 3) == [4, 8, 12, 13]  # 3, 6, 9 owed to the window's end


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def _backward(model: torch.nn.Module) -> None:
    model(torch.randn(2, 3)).sum().backward()


@pytest.mark.parametrize("zero", ["none", "zeros", "at the start"])
def test_a_loop_accumulating_by_hand_is_clean_only_after_its_windows_step(zero: str) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    w = GradientWindow()
    w.install([model, opt])
    seen = []
    for i in range(12):
        if zero == "at the start" and i % 4 == 0:
            opt.zero_grad()
        _backward(model)
        if i % 4 == 3:
            opt.step()
            if zero != "at the start":
                opt.zero_grad(set_to_none=zero == "none")
        seen.append(w.boundary())
    assert seen == [i % 4 == 3 for i in range(12)]


def test_eval_batches_after_a_window_are_clean_and_a_restore_resets() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = GradientWindow()
    w.install([opt])
    _backward(model)
    opt.step()
    opt.zero_grad()
    assert w.boundary()
    with torch.no_grad():
        model(torch.randn(2, 3))
    assert w.boundary()  # no gradient, no step: clean
    _backward(model)
    assert not w.boundary()  # a micro-batch
    clear_grads([model])
    w.reset()
    assert w.boundary()  # restored: the replay starts from no gradient


def test_two_optimizers_each_must_be_clean() -> None:
    a, b = _model(), _model()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    w = GradientWindow()
    w.install([oa, ob])
    _backward(a)
    _backward(b)
    oa.step()  # a steps every batch, b accumulates
    oa.zero_grad()
    assert not w.boundary()
    _backward(a)
    _backward(b)
    oa.step()
    ob.step()
    assert w.boundary()


def test_clear_grads_reaches_modules_and_what_an_optimizer_wrapper_holds() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, opt: Any) -> None:  # never runs Optimizer.__init__ (as AcceleratedOptimizer)
            self.optimizer = opt

    _backward(model)
    clear_grads([Wrapper(inner)])
    assert all(p.grad is None for p in model.parameters())
    _backward(model)
    clear_grads([model])
    assert all(p.grad is None for p in model.parameters())


def test_an_optimizer_without_a_hook_leaves_every_boundary_clean(caplog: pytest.LogCaptureFixture) -> None:
    class Bare(torch.optim.Optimizer):
        def __init__(self) -> None:
            pass

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = GradientWindow()
    with caplog.at_level(logging.WARNING):
        w.install([opt, Bare()])
    assert w.blind and "gradient-accumulation window" in caplog.text
    _backward(model)
    assert w.boundary()  # as before issue 38: it cannot tell


def test_an_accelerated_optimizer_skipping_its_micro_batch_steps() -> None:
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = acc.prepare(_model())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    w = GradientWindow()
    w.install([model, opt])
    seen = []
    for _ in range(8):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(2, 3)).sum())
            opt.step()  # the wrapper steps the AdamW it holds only at the window's last micro-batch
            opt.zero_grad()
        seen.append(w.boundary())
    assert seen == [False, False, False, True] * 2
