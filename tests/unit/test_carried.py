"""Loop-carried values (``job.carry``, ckptless/carried.py) and the start-up check (ckptless/loop_check.py).

The namespace's values go through a real image (capture into the flat buffer and JSON manifest, restore
from a copy of both: no pickle anywhere) and come back equal with their exact types; what an image cannot
hold is refused when it is assigned, naming the attribute. The check reads loops as source.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptless import loop_check
from ckptless.carried import Carried
from ckptless.errors import ConfigError, StateError
from ckptless.state import Capturer, StateImage, StateRegistry, restore
from ckptless.state.manifest import Manifest

# --- the namespace through a real image -------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    t = (torch.rand(shape, generator=g) * 100).to(dtype)
    return t.t() if t.dim() == 2 and draw(st.booleans()) else t  # a non-contiguous one too


scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=8)
           | st.floats(allow_nan=True, allow_infinity=True))
values = st.recursive(scalars | tensors(), lambda inner: st.lists(inner, max_size=3)
                      | st.lists(inner, max_size=3).map(tuple)
                      | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner, max_size=3), max_leaves=8)
names = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,6}", fullmatch=True).filter(
    lambda n: n not in ("names", "state_dict", "load_state_dict") and not n.startswith("_")
    and n.isidentifier() and n not in ("None", "True", "False") and not __import__("keyword").iskeyword(n))


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _through_an_image(src: Carried, dst: Carried) -> None:
    """Capture ``src``, then restore into ``dst`` from the manifest's JSON and a copy of the buffer."""
    reg = StateRegistry(include_rng=False)
    reg.protect(carried=src)
    img = Capturer(reg, job_id="job", owner=0).capture(version=3, generation=1)
    wire = StateImage(Manifest.from_bytes(img.manifest.to_bytes()), img.buffer.clone())
    img.buffer.zero_()  # nothing restored may alias what was captured
    other = StateRegistry(include_rng=False)
    other.protect(carried=dst)
    restore(other, wire)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(names, values, min_size=1, max_size=4), st.data())
def test_carried_values_round_trip_through_an_image_with_their_types(vals: dict[str, Any], data: st.DataObject) -> None:
    src = Carried({k: v for k, v in vals.items()})
    for k in vals:  # assigned in the loop after declaration: the value the image must hold is the last one
        if data.draw(st.booleans()):
            new = data.draw(values)
            setattr(src, k, new)
            vals[k] = new
    dst = Carried({k: None for k in vals})
    _through_an_image(src, dst)
    for k, v in vals.items():
        assert _same(getattr(dst, k), v), (k, v, getattr(dst, k))
    for k, v in vals.items():  # fresh objects: the restored tensors are not the captured ones
        if isinstance(v, torch.Tensor) and v.numel():
            assert getattr(dst, k).data_ptr() != v.data_ptr()


def test_numpy_values_round_trip() -> None:
    src = Carried({"a": np.arange(6, dtype=np.int32).reshape(2, 3), "s": np.float32(1.5), "n": 7})
    dst = Carried({"a": None, "s": None, "n": None})
    _through_an_image(src, dst)
    assert isinstance(dst.a, np.ndarray) and (dst.a == src.a).all() and dst.a.dtype == np.int32
    assert type(dst.s) is np.float32 and dst.s == np.float32(1.5) and dst.n == 7


def test_the_manifest_holds_the_values_as_json_never_pickle() -> None:
    reg = StateRegistry(include_rng=False)
    reg.protect(carried=Carried({"best": 0.25, "step_of_best": 8, "X": torch.arange(4)}))
    img = Capturer(reg, job_id="job", owner=0).capture(version=1, generation=0)
    tree = json.loads(img.manifest.to_bytes())["tree"]
    assert tree == {"d": [["carried", {"d": [["best", 0.25], ["step_of_best", 8], ["X", {"T": 0}]]}]]}


# --- refusals: at assignment, naming the attribute and the value ----------------------------------------


class _Thing:
    pass


@pytest.mark.parametrize("bad", [{1, 2}, _Thing(), lambda: 0, torch.zeros(2, dtype=torch.uint32),
                                 [1, {"k": object()}], {(1, 2): 3}, torch.zeros(2).to_sparse()])
def test_an_unsupported_value_is_refused_when_assigned_naming_it(bad: Any) -> None:
    c = Carried({"best": 0.0})
    with pytest.raises(ConfigError) as info:
        c.best = bad
    assert info.value.field == "carried.best" and info.value.value is bad
    assert "loop-carried value must be a tensor" in str(info.value)
    assert c.best == 0.0  # unchanged
    with pytest.raises(ConfigError, match=r"carried\.X"):
        Carried({"X": bad})


def test_undeclared_names_are_refused_and_declared_ones_cannot_be_deleted() -> None:
    c = Carried({"best_val_loss": 1e9})
    with pytest.raises(ConfigError, match=r"carried\.best_val_los.*not declared.*best_val_loss"):
        c.best_val_los = 0.5  # a typo: would carry a value nobody reads
    with pytest.raises(AttributeError, match="declared: best_val_loss"):
        _ = c.X
    with pytest.raises(ConfigError):
        del c.best_val_loss
    with pytest.raises(ConfigError, match="public Python identifier"):
        Carried({"_hidden": 1})


def test_an_image_with_other_names_is_refused() -> None:
    src, dst = Carried({"a": 1}), Carried({"b": 2})
    with pytest.raises(StateError, match="job.carry"):
        _through_an_image(src, dst)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_device_tensor_is_restored_on_the_current_device() -> None:  # pragma: no cover - GPU machines
    src, dst = Carried({"X": torch.arange(5, device="cuda")}), Carried({"X": None})
    _through_an_image(src, dst)
    assert dst.X.device.type == "cuda" and torch.equal(dst.X.cpu(), torch.arange(5))


# --- the start-up check: which locals a loop carries -----------------------------------------------------

NANOGPT = '''
X, Y = get_batch('train')
t0 = time.time()
best_val_loss = 1e9
iter_num = 0
while True:
    lr = get_lr(iter_num)
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        if losses['val'] < best_val_loss:
            best_val_loss = losses['val']
    for micro_step in range(gradient_accumulation_steps):
        logits, loss = model(X, Y)
        X, Y = get_batch('train')
        loss.backward()
    optimizer.step()
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    print(loss.item(), dt)
    iter_num += 1
    if iter_num > max_iters:
        break
'''


def _names(src: str, line: int) -> list[str]:
    found = loop_check.carried_names(src, line)
    assert found is not None
    return list(found.carried)


def test_nanogpts_loop_carries_its_prefetched_batch_best_metric_counter_and_clock() -> None:
    found = loop_check.carried_names(NANOGPT, 6)
    assert found is not None and found.line == 6
    assert found.carried == {"iter_num": 7, "best_val_loss": 10, "X": 13, "Y": 13, "t0": 18}


@pytest.mark.parametrize("body, carried", [
    ("x = f(step)\n    y = x + 1", []),                                     # assigned before read
    ("loss = f(x)\n    x = g()", ["x"]),                                     # read, then prefetched
    ("n += 1", ["n"]),                                                       # a counter
    ("ema = 0.9 * ema + 0.1 * f()", ["ema"]),
    ("if step % 2:\n        v = 1\n    else:\n        v = 2\n    print(v)", []),  # both branches assign
    ("if step % 2:\n        v = 1\n    print(v)", ["v"]),                    # one branch: last iteration's
    ("if step % 2:\n        v = 1\n    else:\n        continue\n    print(v)", []),  # the other path leaves
    ("for m in range(2):\n        a = f(b)\n        b = g()", ["b"]),         # carried across micro-steps
    ("for m in range(2):\n        b = g()\n    print(b)", []),              # an inner loop runs once at least
    ("with ctx() as h:\n        h.go(z)\n    z = 1", ["z"]),
    ("try:\n        w = f()\n    except E as e:\n        w = 0\n    print(w)", []),
    ("s.best = max(s.best, f())", []),                                        # attributes: objects, not locals
    ("q = [q for q in range(3)]", []),                                        # the comprehension's own name
    ("k = [v for v in k]", ["k"]),
    ("if (m := f()) > best:\n        best = m", ["best"]),
    ("def h():\n        return r\n    r = 1", []),                           # a nested body runs later
    ("del gone\n    gone = 1", ["gone"]),
])
def test_carried_names_of_small_loops(body: str, carried: list[str]) -> None:
    src = f"for step in job.steps(10):\n    {body}\n"
    assert sorted(_names(src, 1)) == sorted(carried)


def test_the_loop_is_found_by_a_line_of_its_header_and_the_innermost_wins() -> None:
    src = "for a in x:\n    for step in job.steps(\n            10):\n        y = y + 1\n"
    assert _names(src, 3) == ["y"] and loop_check.carried_names(src, 2).line == 2  # type: ignore[union-attr]
    assert loop_check.carried_names(src, 4) is None  # a body line is not a header
    assert loop_check.carried_names("x = (", 1) is None  # unparsable: no check


def _steps(n: int, carried: Carried | None, found: list[Any]) -> Any:
    """As ``job.steps`` does at its first step: the check on the frame that iterates it."""
    found.append(loop_check.warn_unprotected(sys._getframe(1), carried))
    yield from range(n)


def _loop_with_unprotected_locals(carried: Carried | None) -> loop_check.LoopFinding | None:
    X, best = 0, 1e9
    found: list[Any] = []
    for step in _steps(2, carried, found):
        if X < best:
            best = X
        X = step
    return found[0]


def test_the_check_warns_once_naming_the_loop_and_its_locals(caplog: pytest.LogCaptureFixture) -> None:
    loop_check._SEEN.clear()
    with caplog.at_level(logging.WARNING, logger="ckptless.loop_check"):
        found = _loop_with_unprotected_locals(None)
        _loop_with_unprotected_locals(None)  # the same loop again: no second line
    assert found is not None and list(found.carried) == ["X", "best"]
    lines = [r.getMessage() for r in caplog.records if loop_check.HINT in r.getMessage()]
    assert len(lines) == 1, lines
    assert "test_carried.py" in lines[0] and f"{loop_check.HINT}: X, best" in lines[0]
    assert "job.carry(X=..., best=...)" in lines[0]


def test_ignored_names_are_not_named(caplog: pytest.LogCaptureFixture) -> None:
    loop_check._SEEN.clear()
    with caplog.at_level(logging.WARNING, logger="ckptless.loop_check"):
        _loop_with_unprotected_locals(Carried({}, ignore=("X", "best")))
    assert not [r for r in caplog.records if loop_check.HINT in r.getMessage()]


# --- a rollback in one process: the prefetching loop resumes exactly only with its values carried ---------


def _prefetch_run(steps: int, rollback_at: tuple[int, int] | None, carry: bool) -> dict[str, torch.Tensor]:
    """nanoGPT's loop shape on one process: batches drawn from the global torch stream, the next one
    prefetched inside the step, a best metric. ``rollback_at=(v, s)``: at the end of step ``s`` the
    survivor rolls back to version ``v`` (captured when the loop reached it) and trains on from there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, 8)
        return x, x.sum(1, keepdim=True)

    X, Y = get_batch()
    c = Carried({"X": X, "Y": Y, "best": 1e9}) if carry else None
    reg = StateRegistry()
    reg.protect(model=model, optimizer=opt, **({"carried": c} if c is not None else {}))
    cap = Capturer(reg, job_id="job", owner=0)
    images: dict[int, StateImage] = {0: cap.capture(version=0, generation=0)}
    best, step = 1e9, 0
    rolled = False
    while step < steps:
        x, y = (c.X, c.Y) if c is not None else (X, Y)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if c is not None:
            c.X, c.Y = get_batch()
            c.best = min(c.best, loss.item())
        else:
            X, Y = get_batch()
            best = min(best, loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        images[step] = cap.capture(version=step, generation=0)  # the end of the step's body
        if rollback_at is not None and not rolled and step == rollback_at[1]:
            rolled = True
            restore(reg, images[rollback_at[0]])
            step = rollback_at[0]
    return {**{k: v.detach().clone() for k, v in model.state_dict().items()},
            "best": torch.tensor(c.best if c is not None else best)}


@pytest.mark.parametrize("v, s", [(3, 5), (1, 7), (6, 6)])
def test_a_prefetching_loop_rolled_back_is_bitwise_only_with_its_values_carried(v: int, s: int) -> None:
    want = _prefetch_run(10, None, carry=True)
    got = _prefetch_run(10, (v, s), carry=True)
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]
    # the same loop with plain locals: same model, optimizer and RNG restored, the prefetched batch not
    plain_want, plain_got = _prefetch_run(10, None, carry=False), _prefetch_run(10, (v, s), carry=False)
    assert all(torch.equal(want[k], plain_want[k]) for k in want)  # the two loops are the same training
    if v != s:
        assert not all(torch.equal(plain_want[k], plain_got[k]) for k in want if k != "best")


_VARS = ("a", "b", "c", "d")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_VARS), st.lists(st.sampled_from(_VARS), max_size=3),
                          st.sampled_from(("=", "+="))), min_size=1, max_size=8))
def test_straight_line_bodies_match_a_reference_reading(stmts: list[tuple[str, list[str], str]]) -> None:
    """For a body of assignments the carried names are exactly those read before their first assignment
    (``x += ...`` reads x first) and assigned somewhere: the reference, executed statement by statement."""
    lines, assigned, want, stored = [], set(), set(), set()
    for target, reads, op in stmts:
        lines.append(f"    {target} {op} {' + '.join(reads) or '0'}")
        for r in reads + ([target] if op == "+=" else []):
            if r not in assigned:
                want.add(r)
        assigned.add(target)
        stored.add(target)
    src = "for step in job.steps(10):\n" + "\n".join(lines) + "\n"
    assert set(_names(src, 1)) == want & stored
