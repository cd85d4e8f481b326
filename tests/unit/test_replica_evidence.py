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
         nodes: list[str] | None = NODES, world: int | None = None,
         device: str = "cpu") -> tuple[list[MirrorEngine], list[BaseException | None], float]:
    """v1 committed everywhere; then v2 with the ``flipped`` ranks' moment flipped before the capture.
    Returns the engines, each one's error, and how long a wait for v2 took on rank 0. ``nodes`` None:
    no node layout (each rank its own host), ``world`` ranks."""
    sets = sets or [list(range(W))]
    world = len(nodes) if nodes is not None else (world or W)
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



# --- a review of issue 35's verdict: deferral, holders, one node --------------------------------------------
def _submit(e: MirrorEngine, cap: Capturer, version: int, defer: bool, abstain_with: nn.Module | None = None) -> None:
    """Capture and submit; ``abstain_with``: bump that model's first parameter's version counter after a
    deferred capture (bytes unchanged), so this rank's live prefix is untrusted and it abstains."""
    plan = cap.plan()
    buf = e.acquire_buffer(plan.nbytes(defer), shrink=defer)
    img = cap.capture(version, 0, out=buf, checksum_now=False, plan=plan, defer_prefix=defer)
    if abstain_with is not None:
        with torch.no_grad():
            next(abstain_with.parameters()).add_(0)
    e.submit(img.manifest, img.buffer, live=img.live)


def _settled(engines: list[MirrorEngine]) -> list[BaseException | None]:
    for e in engines:
        try:
            e.wait_idle(TIMEOUT_S)
        except SilentDataCorruption:
            pass
    return [e.error for e in engines]


@pytest.mark.parametrize("abstains_again", [False, True], ids=["decided-next-round", "undecided-twice"])
def test_an_abstaining_rank_defers_the_verdict_one_round(abstains_again: bool) -> None:
    """A set of three on three nodes, rank 2 flipped at v2 while rank 0 abstains (its live prefix was
    written under the capture): 1 vs 1 proves nothing, so nothing is committed and nobody is named; at v3
    rank 0 is compared and rank 2 is replaced (it stopped the job before: a review of issue 35). A second
    undecided round stops every rank."""
    nodes = ["a", "b", "c"]
    books = [StrikeBook() for _ in nodes]
    job = f"defer-{abstains_again}"
    engines = engine_world(job, 3, TIMEOUT_S, nodes, books, chunk_bytes=CHUNK, wire_bytes=CHUNK,
                           on_replica_mismatch="replace")
    try:
        ranks = [_replica([0, 1, 2]) for _ in nodes]
        caps = [Capturer(reg, job, r, chunk_bytes=CHUNK) for r, (reg, *_) in enumerate(ranks)]
        for _, model, opt in ranks:
            _step(model, opt, 0)
        for e, cap in zip(engines, caps):
            _submit(e, cap, 1, False)
        assert all(e.wait_committed(1, TIMEOUT_S) for e in engines)
        for r, (_, model, opt) in enumerate(ranks):
            _step(model, opt, 1)
            if r == 2:
                _flip(opt)
        for r, (e, cap) in enumerate(zip(engines, caps)):
            _submit(e, cap, 2, r == 0, ranks[0][1] if r == 0 else None)
        assert _settled(engines) == [None] * 3, "an undecided round named or stopped a rank"
        assert all(e.committed_version == 1 for e in engines) and all(b.deferred for b in books)
        for _, model, opt in ranks:
            _step(model, opt, 2)
        for r, (e, cap) in enumerate(zip(engines, caps)):
            again = abstains_again and r == 0
            _submit(e, cap, 3, again, ranks[0][1] if again else None)
        errors = _settled(engines)
        assert all(e.committed_version == 1 for e in engines)
        if abstains_again:
            for r, err in enumerate(errors):
                assert isinstance(err, SilentDataCorruption) and not err.replace, (r, err)
            assert "the previous round was deferred" in str(errors[1]), errors[1]
        else:
            assert isinstance(errors[2], SilentDataCorruption) and errors[2].replace, errors
            assert "rank 2 (on c) is the odd one" in str(errors[2]), errors[2]
            assert errors[:2] == [None, None] and not any(b.deferred for b in books)
    finally:
        _close(engines)


def test_a_rank_and_its_only_holder_are_never_replaced_together() -> None:
    """Six ranks, each its own host (no node layout: ring holders r -> r + 1), the same flip on ranks 2
    and 3: rank 3 is rank 2's only holder, so replacing both would leave rank 2's private state in no
    process. Every rank stops with one error naming both ranks, the tensor and why."""
    engines, errors, _ = _run("orphan", {2, 3}, defer=False, sets=[list(range(6))], nodes=None, world=6)
    try:
        assert engines[0].placement.holders(2) == (3,)
        for r, err in enumerate(errors):
            assert isinstance(err, SilentDataCorruption) and not err.replace, (r, err)
        text = str(errors[0])
        assert "ranks 2, 3 are the odd ones" in text and "in optimizer.state.0.exp_avg;" in text, text
        assert "rank 2 with its only holder rank 3" in text, text
    finally:
        _close(engines)


def test_a_flipped_rank_of_a_set_on_one_node_stops_the_job() -> None:
    """Four replicas on one node: counting ranks cannot tell a bad device from a bad node there, so even
    one flipped rank of four is not replaced (docs/failure-model.md, "Whose copy is right")."""
    engines, errors, _ = _run("one-node", {2}, defer=False, nodes=["box"] * 4)
    try:
        for r, err in enumerate(errors):
            assert isinstance(err, SilentDataCorruption) and not err.replace, (r, err)
        assert "Every replica runs on box" in str(errors[0]), errors[0]
    finally:
        _close(engines)
