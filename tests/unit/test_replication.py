"""Issue 21: what replicas share, laid out so holders keep only the rest, and recovered from live replicas.

Pure parts: the replica set's compact form, the image layout (replicated prefix first, a whole chunk,
buffers private), the holder's copy (suffix only, verified on its own chunks), and the planner's
availability and stripes for a rank whose holders keep no prefix. The real processes: the CI DDP kill
in tests/e2e/test_ddp_fsdp_e2e.py (its respawn's prefix came from live replicas, bitwise).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ckptless.errors import ConfigError, ManifestError
from ckptless.mirror.store import PeerStore
from ckptless.recovery import RecoveryPlan, plan_recovery
from ckptless.recovery.facts import PlanningFacts, ReplicaFact, WorkerReport
from ckptless.recovery.wire import report_from_json, report_to_json
from ckptless.state import Capturer, StateRegistry, restore
from ckptless.state.manifest import Manifest, TensorEntry
from ckptless.state.replication import ReplicaSet, bad_held_chunks, claim, held_bytes, held_from, region_of
from ckptless.state.tree import tensor_paths_of

from ..harness.plan_worlds import example_facts

CHUNK = 4096


@given(st.sets(st.integers(0, 200), min_size=2, max_size=40))
def test_replica_set_round_trips_and_answers_membership(ranks: set[int]) -> None:
    rs = ReplicaSet.of_ranks(ranks)
    assert rs.ranks == tuple(sorted(ranks))
    assert ReplicaSet.from_json(rs.to_json()) == rs
    for r in range(-1, 202):
        assert (r in rs) == (r in ranks)
    for r in ranks:
        prev, nxt = rs.neighbours(r)
        assert rs.neighbours(nxt)[0] == r and rs.neighbours(prev)[1] == r


def test_a_progression_is_kept_in_constant_size() -> None:
    assert ReplicaSet.of_ranks(range(0, 100_000)).to_json() == {"ap": [0, 1, 100_000]}
    assert ReplicaSet.of_ranks(range(3, 64, 8)).to_json() == {"ap": [3, 8, 8]}
    with pytest.raises(ConfigError, match="replicated_over"):
        ReplicaSet.of_ranks([5])
    with pytest.raises(ManifestError):
        ReplicaSet.from_json({"ap": [0, 0, 4]})


def _job(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(16, 64)).square().mean().backward()
    opt.step()
    return model, opt


def _capture(rank: int, seed: int = 0, over: list[int] | None = None) -> tuple[StateRegistry, object]:
    model, opt = _job(seed)
    reg = StateRegistry()
    reg.protect(replicated_over=over if over is not None else [0, 1, 2, 3], model=model, optimizer=opt)
    return reg, Capturer(reg, "job", rank, chunk_bytes=CHUNK).capture(7, 1)


def test_parameters_and_their_optimizer_state_form_a_whole_chunk_prefix_buffers_stay_private() -> None:
    reg, img = _capture(1)
    m = img.manifest  # type: ignore[attr-defined]
    region = region_of(m)
    assert region is not None and region.ranks == ReplicaSet.of_ranks([0, 1, 2, 3]) and not region.mirrored
    assert region.bytes % CHUNK == 0 and 0 < region.bytes < m.total_bytes
    model = reg["model"]
    n_params = sum(p.numel() * 4 for p in model.parameters())  # type: ignore[attr-defined]
    in_prefix = sum(e.nbytes for e in m.tensors if e.offset < region.bytes)
    assert in_prefix >= 3 * n_params  # parameters, exp_avg, exp_avg_sq (and the step counters)
    states = {name: obj.state_dict() for name, obj in reg.items()}
    _, ptrs = claim(reg.items(), states, reg.replicated(), 1)
    assert all(("cpu", p.data_ptr()) in ptrs for p in model.parameters())  # type: ignore[attr-defined]
    for buf in model.buffers():  # type: ignore[attr-defined]  # BatchNorm's running statistics: rank-local
        assert ("cpu", buf.data_ptr()) not in ptrs
    # Replicas with the same state have byte-identical prefixes; the suffix holds the RNG, so ranks differ there.
    _, other = _capture(2)
    a = img.buffer[: region.bytes]  # type: ignore[attr-defined]
    b = other.buffer[: region.bytes]  # type: ignore[attr-defined]
    assert torch.equal(a, b)
    assert m.chunk_checksums[: region.bytes // CHUNK] == other.manifest.chunk_checksums[: region.bytes // CHUNK]  # type: ignore[attr-defined]
    # The image restores exactly (offsets are not in tensor order any more).
    fresh, _ = _job(seed=3)
    reg2 = StateRegistry()
    reg2.protect(replicated_over=[0, 1, 2, 3], model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    restore(reg2, img)  # type: ignore[arg-type]
    for p, q in zip(fresh.parameters(), model.parameters()):  # type: ignore[attr-defined]
        assert torch.equal(p, q)


def test_a_rank_outside_its_declared_set_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="replicated_over"):
        _capture(5)


def test_a_holder_keeps_and_verifies_the_suffix_only() -> None:
    _, img = _capture(1)
    m, buf = img.manifest, img.buffer  # type: ignore[attr-defined]
    store = PeerStore("job", 1)
    store.put(m, buf)
    held = store.get(1, 7)
    assert held is not None and held.buffer.numel() == held_bytes(m) == m.total_bytes - held_from(m)
    assert torch.equal(held.buffer, buf[held_from(m): m.total_bytes])
    assert store.bytes_held < m.total_bytes
    assert bad_held_chunks(held.buffer, m) == []
    held.buffer[-1] ^= 1  # at-rest rot in the suffix is found and named by its chunk in the whole image
    assert bad_held_chunks(held.buffer, m) == [len(m.chunk_checksums) - 1]


def _prefixed(facts: PlanningFacts, first: int, peers: tuple[int, ...]) -> PlanningFacts:
    """The example world, with rank 1's images held without a prefix of ``first`` chunks."""
    rs = ReplicaSet.of_ranks(peers)
    reps = tuple(replace(r, replicas=tuple(replace(f, first_chunk=first, peers=rs) if f.owner == 1 else f
                                           for f in r.replicas)) for r in facts.reports)
    return replace(facts, reports=reps)


def test_a_lost_replicas_prefix_comes_from_live_replicas_and_its_suffix_from_holders() -> None:
    facts = _prefixed(example_facts(), 6, (0, 1, 2, 3))
    d = plan_recovery(facts)
    assert isinstance(d, RecoveryPlan) and d.resume_version == 100
    (t,) = d.transfers
    holder = [(s.start, s.stop, s.source) for s in t.stripes if not s.own]
    replicas = [(s.start, s.stop, s.source) for s in t.stripes if s.own]
    assert holder == [(6, 10, "b/w2")] and t.stripes[0].own is False  # the holder sends the manifest
    covered = sorted(c for s in t.stripes for c in range(s.start, s.stop))
    assert covered == list(range(10))
    # Ranks 0, 2 and 3 hold v100 of their own images: each serves a share, the others are fallbacks.
    assert {src for _, _, src in replicas} == {"a/w0", "b/w2", "b/w3"}
    for s in t.stripes:
        if s.own:
            assert set(s.fallbacks) == {"a/w0", "b/w2", "b/w3"} - {s.source}


def test_without_a_live_replica_of_the_version_the_memory_plan_is_not_offered() -> None:
    # Rank 1's only replica is rank 2, which no longer holds v99 or v100 of its own image: nothing in
    # memory has rank 1's prefix, so the plan falls back to the snapshot instead of half an image.
    facts = _prefixed(example_facts(), 6, (1, 2))
    reps = tuple(replace(r, local_versions=frozenset({101}), newest_captured=101, committed=None)
                 if r.worker_id == "b/w2" else r for r in facts.reports)
    d = plan_recovery(replace(facts, reports=reps))
    assert not isinstance(d, RecoveryPlan), d


def test_reports_carry_the_first_chunk_and_the_replica_set() -> None:
    rs = ReplicaSet.of_ranks(range(0, 4096, 2))
    r = WorkerReport("w", 5, 5, frozenset({5}), (ReplicaFact(3, 5, 9, "k", 4, rs), ReplicaFact(4, 5, 9)))
    raw = report_to_json(r)
    assert len(raw) < 400  # the set travels as a progression, not 2,048 ranks
    assert report_from_json(raw) == r
    with pytest.raises(ConfigError):
        ReplicaFact(3, 5, 9, "", 4, None)


# --- replicas checked against each other (mirror/replica_check.py) ----------------------------------------

from ckptless.mirror import replica_check  # noqa: E402
from ckptless.state.replication import Region  # noqa: E402


def _region(*ranks: int) -> Region:
    return Region(CHUNK * 4, ReplicaSet.of_ranks(ranks), False)


def test_agreeing_replicas_find_nothing() -> None:
    assert replica_check.compare(1, _region(0, 1, 2, 3), [5, 6, 7], [5, 6, 7], [5, 6, 7]) == ()


def test_the_odd_rank_and_its_neighbours_each_find_the_chunk() -> None:
    """Locally a rank only learns which neighbours differ where; who is odd is the set's verdict
    (tests/unit/test_replica_verdict.py), the same on every member."""
    region = _region(0, 1, 2, 3)
    good, bad = [5, 6, 7], [5, 6, 8]
    assert replica_check.compare(2, region, bad, good, good) == ((1, (2,)), (3, (2,)))
    assert replica_check.compare(1, region, good, good, bad) == ((2, (2,)),)  # prev 0 agrees, next 2 differs
    assert replica_check.compare(3, region, good, bad, good) == ((2, (2,)),)
    assert replica_check.compare(0, region, good, good, good) == ()


def test_a_set_of_two_compares_its_one_neighbour_once() -> None:
    assert replica_check.compare(0, _region(0, 1), [1, 2], [1, 3], [1, 3]) == ((1, (1,)),)


def test_prefixes_of_different_sizes_are_a_divergence_not_a_hang() -> None:
    d = replica_check.compare(1, _region(0, 1, 2), [1, 2, 3], [-1, -1], [1, 2, 3])
    assert d == ((0, (0, 1, 2)),)


def test_the_finding_names_the_tensors_by_their_paths() -> None:
    _, img = _capture(1)
    m = img.manifest  # type: ignore[attr-defined]
    region = region_of(m)
    assert region is not None
    paths = tensor_paths_of(m.tree)
    names = [paths[i] for i in replica_check.prefix_tensors(m, region, [0])]
    assert names and names[0] == "model.0.weight", names
    last = region.bytes // CHUNK - 1
    assert any(paths[i].startswith("optimizer.state.") for i in replica_check.prefix_tensors(m, region, [last]))


def _brute(m: Manifest, region: Region, chunks: list[int]) -> list[int]:
    """The old O(T x C) scan, the reference."""
    cb = m.chunk_bytes
    spans = [(c * cb, min((c + 1) * cb, region.bytes)) for c in chunks]
    return [i for i, e in enumerate(m.tensors)
            if e.nbytes and e.offset < region.bytes and any(e.offset < b and e.offset + e.nbytes > a for a, b in spans)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 300)), min_size=1, max_size=40), st.integers(16, 128),
       st.data())
def test_the_tensors_of_differing_chunks_are_found_by_bisection_as_by_a_scan(
        layout: list[tuple[int, int]], cb: int, data: st.DataObject) -> None:
    """prefix_tensors (O((T + C) log T)) finds exactly what the old scan over every tensor per chunk did,
    for any tensors (gaps, empty ones, shuffled order) and chunks."""
    entries, pos = [], 0
    for gap, n in layout:
        pos += gap
        entries.append(TensorEntry("uint8", (n,), pos, n))
        pos += n
    entries = data.draw(st.permutations(entries))
    total = max(pos, 1)
    n_chunks = -(-total // cb)
    m = Manifest("j", 0, 1, 0, total, cb, (0,) * n_chunks, tensors=tuple(entries))
    region = Region(data.draw(st.integers(0, total)), ReplicaSet.of_ranks(range(2)), False)
    chunks = sorted(data.draw(st.sets(st.integers(0, n_chunks - 1))))
    assert replica_check.prefix_tensors(m, region, chunks) == _brute(m, region, chunks)
