"""The deferred replicated prefix (issue 21's memory): read from the live tensors, merged at commit.

The checksums read from live tensors must be those of the bytes a whole capture would lay out; a
deferred capture plus its merge must give the very image a whole capture gives; a write under it
must never be committed nor called silent data corruption; and the pool must hold one S, not two.
Engines run on a real Gloo pair in one process (as tests/unit/test_engine_fence.py).
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ckptless.mirror import MirrorEngine
from ckptless.mirror.replica_check import compare
from ckptless.state import Capturer, StateRegistry
from ckptless.state.capture import _layout
from ckptless.state.checksum import chunk_checksums
from ckptless.state.live_prefix import LivePrefix
from ckptless.state.replication import Region, ReplicaSet, held_from
from ckptless.worker.deferral import covered

from ..harness.mirror import engine_pair

CHUNK = 4096
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16, torch.int8]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(DTYPES), st.booleans()), min_size=1, max_size=8),
       st.sampled_from([64, 128, 4096]))
def test_live_checksums_equal_those_of_the_laid_out_bytes(specs: list[tuple[int, torch.dtype, bool]], chunk: int) -> None:
    g = torch.Generator().manual_seed(len(specs) * 7 + chunk)
    tensors = [torch.randint(0, 2, (n,), generator=g).to(dt) if dt == torch.bool
               else (torch.randn(n, generator=g) * 100).to(dt) for n, dt, _ in specs]
    shared = [s for _, _, s in specs]
    entries, total, prefix = _layout(tensors, shared, chunk)
    live = LivePrefix.of(prefix, entries, tensors)
    out = torch.full((max(prefix, 1),), 0xAB, dtype=torch.uint8)  # garbage first: the gaps must be zeroed
    live.copy_into(out)
    assert live.checksums(chunk) == chunk_checksums(out, chunk, prefix)
    assert live.changed() is None
    for p in live.pieces:  # each tensor's bytes by its offset (the replica check's per-tensor digests)
        mv = live.bytes_at(p.entry.offset)
        assert mv is not None and bytes(mv) == bytes(out[p.entry.offset: p.entry.offset + p.entry.nbytes].numpy())
    assert live.bytes_at(prefix + 1) is None
    if live.pieces:
        live.pieces[0].source.view(-1)[:1].zero_()  # an in-place write bumps the version counter
        assert live.changed() is not None


class Counter:
    """A private object (the suffix): a rank's own step counter."""

    def __init__(self, rank: int) -> None:
        self.t = torch.tensor([rank * 1000], dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t.copy_(sd["t"])


def _replica(rank: int) -> tuple[StateRegistry, nn.Module, torch.optim.Optimizer, Counter]:
    torch.manual_seed(0)  # both ranks hold the same model and optimizer: replicas
    model = nn.Sequential(nn.Linear(48, 48), nn.Linear(48, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reg = StateRegistry()
    reg.protect(replicated_over=[0, 1], model=model, optimizer=opt)
    counter = Counter(rank)
    reg.protect(counter=counter)
    return reg, model, opt, counter


def _step(model: nn.Module, opt: torch.optim.Optimizer, counter: Counter, k: int) -> None:
    torch.manual_seed(100 + k)  # the same batch on both replicas: they stay equal
    opt.zero_grad()
    model(torch.randn(8, 48)).square().mean().backward()
    opt.step()
    counter.t += 1


def test_a_deferred_capture_holds_the_suffix_and_reads_the_prefix_live() -> None:
    reg, model, opt, counter = _replica(1)
    _step(model, opt, counter, 0)
    cap = Capturer(reg, "job", 1, chunk_bytes=CHUNK)
    whole = cap.capture(3, 0)
    plan = cap.plan()
    assert plan.can_defer(False) and not plan.can_defer(True) and covered(plan, [opt])
    assert not covered(plan, [])  # an optimizer whose step runs no pre-hook would write it unannounced
    img = cap.capture(3, 0, checksum_now=False, plan=plan, defer_prefix=True)
    live = img.live
    assert live is not None and live.nbytes == plan.prefix and img.buffer.numel() == plan.total - plan.prefix
    assert torch.equal(img.buffer, whole.buffer[plan.prefix: plan.total])
    assert live.checksums(CHUNK) == list(whole.manifest.chunk_checksums[: plan.prefix // CHUNK])
    merged = torch.empty(plan.total, dtype=torch.uint8)
    live.copy_into(merged)
    merged[plan.prefix:].copy_(img.buffer)
    assert torch.equal(merged, whole.buffer[: plan.total])


def _replicas_committed_once(job: str) -> tuple[list[MirrorEngine], list[Any], list[Capturer]]:
    """Two replicas on an engine pair, each stepped once and its first (whole) capture committed as v1."""
    engines = engine_pair(job, 10.0)
    ranks = [_replica(r) for r in (0, 1)]
    caps = [Capturer(reg, job, r, chunk_bytes=CHUNK) for r, (reg, *_) in enumerate(ranks)]
    for r, (_, model, opt, counter) in enumerate(ranks):
        _step(model, opt, counter, 0)
        _capture(engines[r], caps[r], 1, defer=False)  # the first capture of an engine is whole
    assert all(e.wait_committed(1, 20) for e in engines)
    return engines, ranks, caps


def _capture(engine: MirrorEngine, cap: Capturer, version: int, defer: bool) -> Any:
    plan = cap.plan()
    buf = engine.acquire_buffer(plan.nbytes(defer), shrink=defer)
    img = cap.capture(version, 0, out=buf, checksum_now=False, plan=plan, defer_prefix=defer)
    engine.submit(img.manifest, img.buffer, live=img.live)
    return img


def test_a_deferred_round_commits_and_merges_one_whole_image_into_one_s() -> None:
    engines, ranks, caps = _replicas_committed_once("live")
    try:
        size = caps[0].plan().total
        assert all(e.committed_room() >= size for e in engines)
        for version in (2, 3):
            for r, (reg, model, opt, counter) in enumerate(ranks):
                _step(model, opt, counter, version)
                _capture(engines[r], caps[r], version, defer=True)
            assert all(e.wait_committed(version, 20) for e in engines)
            assert all(e.settle_prefix(20) for e in engines)  # what the next optimizer step waits for
            for r, e in enumerate(engines):
                mine = e.local_image(version)
                assert mine is not None, f"rank {r} kept no whole image of v{version}"
                reference = caps[r].capture(version, 0)
                assert torch.equal(mine.buffer, reference.buffer[: reference.manifest.total_bytes])
                assert mine.manifest.chunk_checksums == reference.manifest.chunk_checksums
                assert [i.manifest.version for i in e.own_images()] == [version]  # the suffix buffer is no image
                held = e.store.verified_copy(1 - r, version)
                assert held is not None and held_from(held) == caps[r].plan().prefix  # the peer's suffix only
                assert e.store.bytes_held < caps[r].plan().prefix
        # One S (the committed buffer) plus the suffix: not two S.
        for e in engines:
            assert sum(n for n in (t.numel() for t in e.take_pool())) <= size + 2 * (size - caps[0].plan().prefix) + 64
    finally:
        for e in engines:
            e.close(10)


def test_a_write_under_a_deferred_capture_is_never_committed_nor_called_corruption() -> None:
    engines, ranks, caps = _replicas_committed_once("torn")
    try:
        for r, (reg, model, opt, counter) in enumerate(ranks):
            _step(model, opt, counter, 2)
            if r == 0:
                plan = caps[0].plan()
                buf = engines[0].acquire_buffer(plan.nbytes(True), shrink=True)
                img = caps[0].capture(2, 0, out=buf, checksum_now=False, plan=plan, defer_prefix=True)
                with torch.no_grad():
                    next(model.parameters()).mul_(1.5)  # a weight written outside the optimizer step
                engines[0].submit(img.manifest, img.buffer, live=img.live)
            else:
                _capture(engines[1], caps[1], 2, defer=True)
        assert all(e.wait_idle(20) for e in engines)
        assert all(e.committed_version == 1 and not e.broken for e in engines)  # not committed, no SDC stop
        assert engines[0].live_torn is not None and "outside the optimizer" in engines[0].live_torn
        assert all(e.local_image(1) is not None for e in engines)  # the committed version is still whole
    finally:
        for e in engines:
            e.close(10)


def test_an_abstaining_neighbour_is_not_compared() -> None:
    region = Region(2 * CHUNK, ReplicaSet.of_ranks([0, 1, 2]), False)
    assert compare(0, region, [1, 2], None, [1, 2]) == ()
    assert compare(0, region, [1, 2], None, [1, 3]) == ((1, (1,)),)  # the abstainer (rank 2) is not compared


def test_an_optimizer_step_that_outwaits_the_round_abandons_the_merge_and_nothing_is_torn() -> None:
    engines, ranks, caps = _replicas_committed_once("abandon")
    try:
        for r, (reg, model, opt, counter) in enumerate(ranks):
            _step(model, opt, counter, 2)
        _capture(engines[0], caps[0], 2, defer=True)  # rank 1 has not submitted: the round cannot end
        assert engines[0].settle_prefix(0.3) is False  # the step gives up waiting: v2 is never merged
        reg, model, opt, counter = ranks[0]
        _step(model, opt, counter, 3)  # the optimizer writes the live tensors now
        _capture(engines[1], caps[1], 2, defer=True)
        assert all(e.wait_committed(2, 20) for e in engines)
        assert engines[1].settle_prefix(20) and engines[1].local_image(2) is not None
        assert engines[0].local_image(2) is None  # rank 0 keeps no copy of v2 (a replica serves it)...
        assert all(i.manifest.version == 1 for i in engines[0].own_images())  # ...and nothing torn is offered
        assert engines[0].live_torn is None or "abandoned" in engines[0].live_torn
    finally:
        for e in engines:
            e.close(10)
