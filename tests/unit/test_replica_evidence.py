"""The replica check through the mirror engine, in one process: four engines on a real Gloo group
(one thread each), DDP-like replicas (a model and its AdamW state declared replicated over all four)
on two nodes (ranks 0-1 on "a", 2-3 on "b"), chunks so large that every replicated tensor shares one.

What it shows (issue 35): the set decides by its evidence, the same on every rank (one flipped rank
is replaced and named with the one tensor that differs, not every tensor of its chunk; 2 vs 2 stops
every rank; a rank replaced before stops the job); the version is never committed, and a wait for it
returns at once instead of waiting out the round's deadline.
"""

from __future__ import annotations

import time
import pytest
import torch
from torch import nn

from ckptless.errors import SilentDataCorruption
from ckptless.mirror import MirrorEngine
from ckptless.mirror import replica_verdict as rv
from ckptless.mirror.replica_check import StrikeBook
from ckptless.state import Capturer, StateRegistry

from ..harness.mirror import engine_world

W = 4
NODES = ["a", "a", "b", "b"]
CHUNK = 1 << 20
TIMEOUT_S = 20.0


def _replica(over: list[int], device: str = "cpu") -> tuple[StateRegistry, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(len(over) * 10 + over[0])  # each replica set its own model
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reg = StateRegistry()
    reg.protect(replicated_over=over, model=model, optimizer=opt)
    return reg, model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    torch.manual_seed(100 + k)  # the same batch on every replica: they stay equal
    opt.zero_grad()
    model(torch.randn(8, 16).to(next(model.parameters()).device)).square().mean().backward()
    opt.step()


def _flip(opt: torch.optim.Optimizer) -> None:
    """The lowest bit of the first element of the first parameter's first AdamW moment."""
    first = next(iter(opt.state.values()))["exp_avg"]
    with torch.no_grad():
        first.view(-1)[:1].view(torch.uint8)[:1] ^= 1


def _round(engines: list[MirrorEngine], caps: list[Capturer], version: int, defer: bool) -> None:
    for e, cap in zip(engines, caps):
        plan = cap.plan()
        buf = e.acquire_buffer(plan.nbytes(defer), shrink=defer)
        img = cap.capture(version, 0, out=buf, checksum_now=False, plan=plan, defer_prefix=defer)
        e.submit(img.manifest, img.buffer, live=img.live)


def _run(job: str, flipped: set[int], defer: bool, books: list[StrikeBook] | None = None,
         policy: str = "replace", sets: list[list[int]] | None = None,
         nodes: list[str] | None = None,
         device: str = "cpu") -> tuple[list[MirrorEngine], list[BaseException | None], float]:
    """v1 committed everywhere; then v2 with the ``flipped`` ranks' moment flipped before the capture.
    Returns the engines, each one's error, and how long a wait for v2 took on rank 0."""
    sets = sets or [list(range(W))]
    nodes = nodes or NODES
    world = len(nodes)
    engines = engine_world(job, world, TIMEOUT_S, nodes, books, chunk_bytes=CHUNK, wire_bytes=CHUNK,
                           on_replica_mismatch=policy)
    ranks = [_replica(next(s for s in sets if r in s), device) for r in range(world)]
    caps = [Capturer(reg, job, r, chunk_bytes=CHUNK) for r, (reg, *_) in enumerate(ranks)]
    for _, model, opt in ranks:
        _step(model, opt, 0)
    _round(engines, caps, 1, defer=False)  # an engine's first capture is whole
    assert all(e.wait_committed(1, TIMEOUT_S) for e in engines)
    for r, (_, model, opt) in enumerate(ranks):
        _step(model, opt, 1)
        if r in flipped:
            _flip(opt)
    _round(engines, caps, 2, defer=defer)
    t0 = time.monotonic()
    try:
        committed = engines[0].wait_committed(2, TIMEOUT_S)
        assert committed == (not flipped), "a version with a flipped replica was committed"
    except SilentDataCorruption:
        pass
    took = time.monotonic() - t0
    for e in engines:
        try:
            e.wait_idle(TIMEOUT_S)
        except SilentDataCorruption:
            pass
    return engines, [e.error for e in engines], took


def _close(engines: list[MirrorEngine]) -> None:
    for e in engines:
        e.close(10)


@pytest.mark.parametrize("defer,device", [
    (False, "cpu"), (True, "cpu"),
    pytest.param(False, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))],
    ids=["copied", "live-prefix", "cuda"])
def test_one_flipped_rank_is_named_with_the_one_tensor_that_differs(defer: bool, device: str) -> None:
    """(On a GPU the prefix is copied from device memory into the pinned capture buffer, where the
    per-tensor digests are read.)"""
    books = [StrikeBook() for _ in range(W)]
    engines, errors, took = _run(f"one-{defer}-{device}", {2}, defer, books, device=device)
    try:
        assert took < TIMEOUT_S / 2, f"the wait for an uncommittable version took {took:.1f}s"
        err = errors[2]
        assert isinstance(err, SilentDataCorruption) and err.replace, errors
        text = str(err)
        assert "at step 2: rank 2 (on b) is the odd one" in text, text
        assert "in optimizer.state.0.exp_avg;" in text and "model.0.weight" not in text, text  # not the chunk's all
        assert "ranks 0, 1, 3 hold (3 of 4, on several nodes)" in text, text
        for r in (0, 1, 3):
            assert errors[r] is None, (r, errors[r])
            assert books[r].strikes == [rv.Strike(2, rv.node_key("b"), 2)]
            assert books[r].names[rv.node_key("b")] == "b"
        assert all(e.committed_version == 1 for e in engines)
    finally:
        _close(engines)


def test_the_same_flip_on_both_ranks_of_a_node_stops_every_rank() -> None:
    engines, errors, took = _run("tie", {2, 3}, defer=False)
    try:
        assert took < TIMEOUT_S / 2, f"the wait for an uncommittable version took {took:.1f}s"
        texts = set()
        for r, err in enumerate(errors):
            assert isinstance(err, SilentDataCorruption) and not err.replace, (r, err)
            texts.add(str(err))
        assert len(texts) == 1, texts  # every rank decided alike
        text = texts.pop()
        assert "no majority: ranks 0, 1 (all on a) hold one copy, ranks 2, 3 (all on b) hold another" in text, text
        assert "optimizer.state.0.exp_avg" in text and "either node may be the faulty one" in text, text
    finally:
        _close(engines)


def test_a_rank_replaced_before_that_differs_again_stops_the_job() -> None:
    earlier = rv.Strike(2, rv.node_key("b"), 1)
    books = [StrikeBook([earlier] if r != 2 else [], {rv.node_key("b"): "b"}) for r in range(W)]
    engines, errors, _ = _run("again", {2}, defer=False, books=books)
    try:
        for r, err in enumerate(errors):
            assert isinstance(err, SilentDataCorruption) and not err.replace, (r, err)
        text = str(errors[0])
        assert "rank 2 (on b) is the odd one again, in optimizer.state.0.exp_avg" in text and "rank 2 on b at step 1" in text, text
    finally:
        _close(engines)


def test_policy_stop_names_the_odd_rank_and_stops_every_rank() -> None:
    engines, errors, _ = _run("stop", {1}, defer=False, policy="stop")
    try:
        for r, err in enumerate(errors):
            assert isinstance(err, SilentDataCorruption) and not err.replace, (r, err)
        assert "rank 1 (on a) is the odd one" in str(errors[3]) and "policy: stop" in str(errors[3])
    finally:
        _close(engines)


def test_each_replica_set_decides_from_its_own_members() -> None:
    """Two sets of three interleaved over six ranks on three nodes (as HSDP's replicate groups): a flip in
    rank 3 is found by its set {1, 3, 5} (its tree is not the mirror group's), the other set agrees."""
    nodes = ["a", "a", "b", "b", "c", "c"]
    books = [StrikeBook() for _ in nodes]
    engines, errors, _ = _run("sets", {3}, defer=False, books=books, sets=[[0, 2, 4], [1, 3, 5]], nodes=nodes)
    try:
        assert isinstance(errors[3], SilentDataCorruption) and errors[3].replace, errors
        assert "rank 3 (on b) is the odd one" in str(errors[3]) and "ranks 1, 5 hold (2 of 3" in str(errors[3])
        assert [errors[r] for r in (0, 1, 2, 4, 5)] == [None] * 5
        assert books[1].strikes == books[5].strikes == [rv.Strike(3, rv.node_key("b"), 2)]
        assert books[0].strikes == books[2].strikes == books[4].strikes == []
    finally:
        _close(engines)


def test_replicas_that_agree_commit_as_before() -> None:
    engines, errors, _ = _run("clean", set(), defer=True)
    try:
        assert errors == [None] * W and all(e.committed_version == 2 for e in engines)
    finally:
        _close(engines)

