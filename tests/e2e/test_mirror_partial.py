"""Partial mirror rounds after a recovery, the one-buffer pool and the send-rate cap.

Real Gloo processes (spawned) where the protocol matters; the pair function is
checked with hypothesis. A "simulated recovery" is what the job does: the next
generation builds a new engine on a new group with the survivors' old stores
(the replacement gets an empty one) and every rank re-captures the resume
version with the new generation number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.errors import MirrorError
from ckptless.mirror import MISSING, MirrorConfig, MirrorEngine, PeerStore, compute_placement, pairs_to_send
from ckptless.mirror.partial import check_pairs, digest, my_missing_pairs, placement_pairs, same_image
from ckptless.state.checksum import chunk_checksums
from ckptless.state.manifest import Manifest

from ..harness.mirror import CHUNK, fill, init_gloo, new_engine, pattern, rss_bytes, spawn_scenarios

JOB = "partial-job"
N = 64 * CHUNK  # 256 KiB images


def capture(eng: MirrorEngine, version: int, nbytes: int = N) -> tuple[Manifest, torch.Tensor]:
    return fill(eng, version, nbytes, job=JOB)


def engine(gen: int, store: PeerStore | None = None, **kw: Any) -> MirrorEngine:
    return new_engine(JOB, gen, store, **kw)


def recover(old: MirrorEngine, lost: int, gen: int, **kw: Any) -> MirrorEngine:
    """Next generation: survivors keep their store, rank ``lost`` comes back with an empty one."""
    old.close()
    store = PeerStore(JOB, gen) if old.rank == lost else old.store
    return engine(gen, store, **kw)


def holds(eng: MirrorEngine, version: int) -> dict[str, bool]:
    """For each owner this rank holds: is the held image of ``version`` bitwise the owner's?"""
    out = {}
    for o in eng.placement.owners_held_by(eng.rank):
        img = eng.store.get(o, version)
        out[str(o)] = img is not None and torch.equal(img.buffer, pattern(o, version, N))
    return out


def last(eng: MirrorEngine) -> dict[str, Any]:
    h = eng.history[-1]
    return {"committed": h.committed, "sent": h.bytes_sent, "received": h.bytes_received, "kept": list(h.kept),
            "missing": list(h.missing), "pairs": None if h.pairs is None else sorted(list(p) for p in h.pairs)}


# --- scenarios (one process per rank) -----------------------------------------------------------
def sc_partial(world: int, rank: int) -> dict[str, Any]:
    """gen 0: v1, v2 committed. Rank 2 lost. gen 1: partial v2 (explicit pairs), then full v3.
    Rank 0 lost. gen 2: partial v3 with MISSING (the engine finds the pairs), then full v4."""
    out: dict[str, Any] = {}
    eng = engine(0)
    for v in (1, 2):
        eng.submit(*capture(eng, v))
        assert eng.wait_committed(v, timeout=20)
    eng = recover(eng, lost=2, gen=1)
    pl = eng.placement
    pairs = pairs_to_send(pl, 2, lambda h, o, v: 2 not in (h, o))  # the lost rank's pairs, from the plan
    out["pairs_explicit"] = sorted(list(p) for p in pairs)
    eng.submit(*capture(eng, 2), pairs=pairs)
    assert eng.wait_idle(timeout=20)
    out["partial"] = last(eng) | {"holds": holds(eng, 2), "pinned_kept": eng.store.get(
        pl.owners_held_by(rank)[0], 2) is not None}
    eng.submit(*capture(eng, 3))
    assert eng.wait_committed(3, timeout=20)
    out["full_after"] = last(eng) | {"holds": holds(eng, 3)}
    eng = recover(eng, lost=0, gen=2)
    eng.submit(*capture(eng, 3), pairs=MISSING)
    assert eng.wait_idle(timeout=20)
    out["auto"] = last(eng) | {"holds": holds(eng, 3)}
    eng.submit(*capture(eng, 4))
    assert eng.wait_committed(4, timeout=20)
    out["auto_then_full"] = last(eng)
    eng.close()
    return out


def sc_lacking(world: int, rank: int) -> dict[str, Any]:
    """A pair the job wrongly believes kept: its holder lacks the image, so the round must not commit;
    the replicas the previous generation left stay intact; the next full round commits."""
    eng = engine(0)
    for v in (1, 2):
        eng.submit(*capture(eng, v))
        assert eng.wait_committed(v, timeout=20)
    eng = recover(eng, lost=2, gen=1)
    pairs = pairs_to_send(eng.placement, 2, lambda h, o, v: o != 2)  # forgets what rank 2 held for others
    eng.submit(*capture(eng, 2), pairs=pairs)
    assert eng.wait_idle(timeout=20)
    out: dict[str, Any] = {"partial": last(eng), "broken": eng.broken, "committed": eng.committed_version,
                           "old_intact": holds(eng, 2)}
    eng.submit(*capture(eng, 3))
    assert eng.wait_committed(3, timeout=20)
    out["full_after"] = last(eng) | {"holds": holds(eng, 3)}
    eng.close()
    return out


def sc_mismatch(world: int, rank: int) -> dict[str, Any]:
    """Ranks given different pair sets: an out-of-step error (engine broken), never a silent commit."""
    eng = engine(0, timeout_s=4.0)
    eng.submit(*capture(eng, 1))
    assert eng.wait_committed(1, timeout=20)
    pairs = frozenset() if rank == 0 else placement_pairs(eng.placement)
    try:
        eng.submit(*capture(eng, 2), pairs=pairs)
        eng.wait_idle(timeout=20)
    except MirrorError:
        pass
    out = {"broken": eng.broken, "cause": type(eng.error).__name__, "committed": eng.committed_version}
    eng.retire()
    return out


def sc_pool1(world: int, rank: int) -> dict[str, Any]:
    """One capture buffer, 50 rounds back to back: no deadlock, one allocation, memory flat."""
    eng = engine(0, pool_buffers=1)
    ptrs: tuple[list[int], list[int]] | None = None
    rss0 = 0
    waited_for_round = True
    for v in range(1, 51):
        m, buf = capture(eng, v)
        # acquire returned only once the previous round had finished (no longer in flight)
        waited_for_round &= len(eng.history) == v - 1
        eng.submit(m, buf)
        if v == 10:
            assert eng.wait_idle(timeout=20)
            ptrs, rss0 = (eng.pool_ptrs(), eng.store.slot_ptrs()), rss_bytes()
    assert eng.wait_committed(50, timeout=30)
    out = {"committed": eng.committed_version, "pool": len(eng.pool_ptrs()), "waited_for_round": waited_for_round,
           "ptrs_stable": ptrs == (eng.pool_ptrs(), eng.store.slot_ptrs()), "rss_growth": rss_bytes() - rss0,
           "local_when_idle": eng.local_image() is not None}
    eng.acquire_buffer(N, timeout=5)  # capturing again gives the committed local copy up
    out["local_while_capturing"] = eng.local_image() is not None
    eng.close()
    return out


def sc_rate(world: int, rank: int) -> dict[str, Any]:
    """A send-rate cap stretches the round to about bytes / rate and still commits."""
    eng = engine(0, max_send_bytes_s=float(4 * N))  # 1 MiB image at 1 MiB/s -> >= ~0.25 s per round
    eng.submit(*capture(eng, 1))
    assert eng.wait_committed(1, timeout=20)
    out = {"seconds": eng.history[-1].seconds, "committed": eng.committed_version}
    eng.close()
    return out


def sc_adopt(world: int, rank: int) -> dict[str, Any]:
    """What a recovery does since worker/reuse.py: rank 2 lost at v2. Survivors mirror their own
    committed image of v2 as is (manifest re-stamped to generation 1); the replacement mirrors the
    image it received (here: the same bytes in a fresh buffer). Then the old engine's free buffer
    goes to the new pool, and the next capture reuses it instead of allocating."""
    old = engine(0)
    for v in (1, 2):
        old.submit(*capture(old, v))
        assert old.wait_committed(v, timeout=20)
    own = old.local_image(2)
    assert own is not None
    old.close()
    if rank == 2:
        buf = pattern(2, 2, N).clone()
        m = Manifest(JOB, 2, 2, 0, N, CHUNK, tuple(chunk_checksums(buf, CHUNK, N)), extra={"v": 2})
        new, image = engine(1, PeerStore(JOB, 1)), (m, buf)
    else:
        new, image = engine(1, old.store), (own.manifest, own.buffer)
    new.submit(dataclasses.replace(image[0], generation=1), image[1], pairs=MISSING)
    assert new.wait_idle(timeout=20)
    out: dict[str, Any] = {"partial": last(new) | {"holds": holds(new, 2)},
                           "adopted": image[1].data_ptr() in new.pool_ptrs()}
    old_ptrs = set(old.pool_ptrs())
    out["donated"] = new.donate([t for t in old.take_pool() if t.data_ptr() != image[1].data_ptr()])
    assert new.wait_committed(2, timeout=20)
    nm, nb = capture(new, 3)
    out["reused"] = nb.data_ptr() in old_ptrs
    new.submit(nm, nb)
    assert new.wait_committed(3, timeout=20)
    out["after"] = last(new) | {"holds": holds(new, 3), "pool": len(new.pool_ptrs())}
    new.close()
    return out


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "adopt": sc_adopt,
    "partial": sc_partial, "lacking": sc_lacking, "mismatch": sc_mismatch, "pool1": sc_pool1, "rate": sc_rate,
}


def worker(rank: int, world: int, store_path: str, out_dir: str, names: list[str]) -> None:
    results: dict[str, Any] = {}
    try:
        init_gloo(rank, world, store_path)
        for name in names:
            t0 = time.monotonic()
            try:
                results[name] = SCENARIOS[name](world, rank)
                results[name]["_s"] = time.monotonic() - t0
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    except Exception:
        results["_fatal"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:  # before teardown, which a broken
        json.dump(results, f)                                         # round's leftovers may disturb
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # "mismatch" last: it leaves a broken round's operations behind on its group
    return spawn_scenarios(worker, 4, ["partial", "adopt", "lacking", "pool1", "rate", "mismatch"],
                           tmp_path_factory.mktemp("partial4"), 120)


# --- protocol tests ------------------------------------------------------------------------------
def test_partial_round_moves_only_the_listed_pairs_and_commits(four: list[dict[str, Any]]) -> None:
    pl = compute_placement(4, 1, "ring")
    want = {(pl.owners_held_by(2)[0], 2), (2, pl.holders(2)[0])}
    for r, res in enumerate(four):
        p = res["partial"]["partial"]
        assert {tuple(x) for x in res["partial"]["pairs_explicit"]} == want
        assert p["committed"] == 2 and p["missing"] == [] and all(p["holds"].values())
        moved_from = {o for o, _ in want}
        moved_to = {h for _, h in want}
        assert p["sent"] == (N if r in moved_from else 0), (r, p)
        assert p["received"] == (N if r in moved_to else 0), (r, p)
        assert p["kept"] == ([] if r in moved_to else list(pl.owners_held_by(r)))


def test_full_round_after_partial_commits(four: list[dict[str, Any]]) -> None:
    for res in four:
        f = res["partial"]["full_after"]
        assert f["committed"] == 3 and f["pairs"] is None and f["sent"] == N and all(f["holds"].values())
        assert res["partial"]["auto_then_full"]["committed"] == 4


def test_missing_mode_moves_only_what_the_replacement_lacks(four: list[dict[str, Any]]) -> None:
    """Rank 0 replaced: its own image of v3 is the same bytes its holder kept, so only the image
    it held for its owner moves."""
    pl = compute_placement(4, 1, "ring")
    want = [[pl.owners_held_by(0)[0], 0]]
    for r, res in enumerate(four):
        a = res["partial"]["auto"]
        mine = [pair for pair in want if r in pair]  # MISSING: a rank learns only the pairs it is in
        assert a["pairs"] == mine and a["committed"] == 3 and all(a["holds"].values())
        assert a["sent"] == (N if r == want[0][0] else 0) and a["received"] == (N if r == 0 else 0)


def test_restored_image_mirrored_as_is_and_old_buffers_reused(four: list[dict[str, Any]]) -> None:
    """The survivors' own images and the replacement's received one are adopted, not re-captured:
    only the image the lost rank held for its owner moves; the old pool's free buffer is reused."""
    pl = compute_placement(4, 1, "ring")
    want = [[pl.owners_held_by(2)[0], 2]]
    for r, res in enumerate(four):
        a = res["adopt"]
        p = a["partial"]
        mine = [pair for pair in want if r in pair]  # MISSING: a rank learns only the pairs it is in
        assert p["pairs"] == mine and p["committed"] == 2 and all(p["holds"].values()), (r, p)
        assert p["sent"] == (N if r == want[0][0] else 0) and p["received"] == (N if r == 2 else 0)
        assert a["adopted"]
        if r != 2:  # survivors had a second, free buffer in the old pool
            assert a["donated"] == 1 and a["reused"], (r, a)
        assert a["after"]["committed"] == 3 and all(a["after"]["holds"].values())
        assert a["after"]["pool"] <= 2


def test_holder_lacking_the_version_blocks_the_commit(four: list[dict[str, Any]]) -> None:
    pl = compute_placement(4, 1, "ring")
    for r, res in enumerate(four):
        lk = res["lacking"]
        assert lk["committed"] is None and lk["partial"]["committed"] is None and not lk["broken"]
        assert lk["partial"]["missing"] == (list(pl.owners_held_by(2)) if r == 2 else [])
        if r != 2:  # what the previous generation left is untouched: a second failure plans from it
            assert all(lk["old_intact"].values())
        assert lk["full_after"]["committed"] == 3 and all(lk["full_after"]["holds"].values())


def test_different_pair_sets_break_the_round_not_commit(four: list[dict[str, Any]]) -> None:
    for res in four:
        m = res["mismatch"]
        assert m["broken"] and m["committed"] == 1, m


def test_one_buffer_pool_50_rounds_no_deadlock_memory_flat(four: list[dict[str, Any]]) -> None:
    for res in four:
        p = res["pool1"]
        assert p["committed"] == 50 and p["pool"] == 1 and p["ptrs_stable"] and p["waited_for_round"]
        assert p["rss_growth"] < 16 << 20, p["rss_growth"]
        assert p["local_when_idle"] and not p["local_while_capturing"]


def test_send_rate_cap_stretches_the_round(four: list[dict[str, Any]]) -> None:
    for res in four:
        assert res["rate"]["committed"] == 1 and res["rate"]["seconds"] >= 0.2, res["rate"]


# --- pure functions -----------------------------------------------------------------------------
worlds = st.integers(2, 12).flatmap(lambda w: st.tuples(
    st.just(w), st.integers(1, w - 1), st.sampled_from(["ring", "group", "mixed"]),
    st.sets(st.tuples(st.integers(0, w - 1), st.integers(0, w - 1)))))


@settings(max_examples=200, deadline=None)
@given(worlds)
def test_pairs_to_send_is_exactly_the_lacking_pairs(case: tuple[int, int, str, set[tuple[int, int]]]) -> None:
    w, k, strategy, held = case  # held: (holder, owner) pairs that hold the version
    pl = compute_placement(w, k, strategy)
    got = pairs_to_send(pl, 7, lambda h, o, v: v == 7 and (h, o) in held)
    want = {(o, h) for o in range(w) for h in pl.holders(o) if (h, o) not in held}
    assert got == want and got <= placement_pairs(pl)
    assert check_pairs(pl, got) == got
    # Every pair of the placement then holds the version: exactly the commit rule's condition.
    assert all((h, o) in held or (o, h) in got for (o, h) in placement_pairs(pl))


@settings(max_examples=100, deadline=None)
@given(worlds, st.integers(0, 2**31))
def test_pairwise_fingerprints_give_the_same_pairs(case: tuple[int, int, str, set[tuple[int, int]]], seed: int) -> None:
    """MISSING mode: each rank decides its own pairs from the fingerprints swapped along them; both ends
    of every pair decide alike, and the union is pairs_to_send over the same holdings."""
    w, k, strategy, held = case
    pl = compute_placement(w, k, strategy)
    own = [digest(Manifest(JOB, o, 7, 3, 10, 4, (o, seed, 1))) for o in range(w)]
    stale = [Manifest(JOB, o, 7, 1, 10, 4, (o, seed, 2)) for o in range(w)]  # other bytes: not held

    def copy(h: int, o: int) -> int:  # holder h's fingerprint of owner o's image
        return digest(Manifest(JOB, o, 7, 1, 10, 4, (o, seed, 1)) if (h, o) in held else
                      (stale[o] if (h + o) % 2 else None))

    per_rank = [my_missing_pairs(r, own[r], {h: copy(h, r) for h in pl.holders(r)},
                                 {o: copy(r, o) for o in pl.owners_held_by(r)},
                                 {o: own[o] for o in pl.owners_held_by(r)}) for r in range(w)]
    want = pairs_to_send(pl, 7, lambda h, o, v: (h, o) in held)
    assert frozenset().union(*per_rank) == want
    for r, mine in enumerate(per_rank):  # a rank decides exactly its own pairs, and its peers agree
        assert mine == {(o, h) for (o, h) in want if r in (o, h)}


def test_same_image_ignores_only_the_generation() -> None:
    a = Manifest(JOB, 1, 5, 0, 8, 4, (1, 2))
    assert same_image(a, Manifest(JOB, 1, 5, 9, 8, 4, (1, 2))) and digest(a) == digest(Manifest(JOB, 1, 5, 9, 8, 4, (1, 2)))
    assert not same_image(a, Manifest(JOB, 1, 5, 0, 8, 4, (1, 3))) and digest(a) != digest(Manifest(JOB, 1, 5, 0, 8, 4, (1, 3)))
    assert digest(None) == 0 and digest(a) > 0


def test_stray_pairs_rejected() -> None:
    pl = compute_placement(4, 1, "ring")
    with pytest.raises(MirrorError):
        check_pairs(pl, [(0, 0)])


def test_pool_buffers_config() -> None:
    assert MirrorConfig().pool_buffers == 2
    assert MirrorConfig.build(pool_buffers=1).pool_buffers == 1
