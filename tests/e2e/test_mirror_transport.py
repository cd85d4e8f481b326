"""Mirror transport + commit protocol: pure rule (hypothesis) and real multi-process Gloo."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.mirror.commit import committed_version, decide, encode, round_ack
from ckptless.mirror.placement import compute_placement
from ckptless.mirror.transport import Header, job_hash

from ..harness import mirror_workers as workers
from ..harness.mirror import spawn_scenarios


# --- pure commit rule ------------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    w=st.integers(2, 8), k=st.integers(1, 3), strategy=st.sampled_from(["ring", "group", "mixed"]),
    fails=st.lists(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=2), min_size=1, max_size=12),
)
def test_round_protocol_matches_definition(w: int, k: int, strategy: str, fails: list[list[tuple[int, int]]]) -> None:
    """Simulate rounds with pinned double-buffered holders and random failed (owner, holder) transfers:
    the MIN-of-acks decision equals the definition applied to what every rank actually holds."""
    k = min(k, w - 1)
    p = compute_placement(w, k, strategy)
    slots: dict[tuple[int, int], list[int]] = {}  # (holder, owner) -> complete versions held (<= 2)
    committed: int | None = None
    for v, failed in enumerate(fails, start=1):
        bad = {(o % w, h % w) for o, h in failed}
        acks = []
        for r in range(w):
            ok = {}
            for o in p.owners_held_by(r):
                held = slots.setdefault((r, o), [])
                if len(held) == 2:  # reuse the unpinned, older slot
                    held.remove(min(x for x in held if x != committed) if committed in held else min(held))
                ok[o] = (o, r) not in bad
                if ok[o]:
                    held.append(v)
            acks.append(encode(round_ack(v, True, ok), v))
        reduced = [min(a[i] for a in acks) for i in range(3)]
        out = decide(reduced, committed)
        committed = out.committed
        # Owners keep the committed and the latest image locally.
        facts = {r: {(o, x) for (h, o), xs in slots.items() if h == r for x in xs} for r in range(w)}
        for r in range(w):
            facts[r] |= {(r, x) for x in {v, committed} if x is not None}
        assert committed == committed_version(p, facts)


def test_decide_rejects_out_of_step_and_old() -> None:
    assert decide(encode(5, 5), 4).advanced
    out = decide([3, 3, -5], 2)  # versions 3..5 in one round: out of step
    assert not out.in_step and out.committed == 2
    assert decide(encode(-1, 6), 5).committed == 5
    assert decide(encode(4, 4), 5).committed == 5  # never goes backwards


def test_header_roundtrip_and_job_hash() -> None:
    h = Header(1, job_hash("a"), 2, 3, 4, 5, 6, 7)
    assert Header.from_tensor(torch.tensor(h.to_list(), dtype=torch.int64)) == h
    assert job_hash("a") != job_hash("b") and 0 <= job_hash("a") < 2**63


# --- real Gloo ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_scenarios(workers.worker, 3, ["bitwise", "corrupt", "memory"], tmp_path_factory.mktemp("mirror3"), 90)


def test_replicas_bitwise_equal_and_commit_advances(three_ranks: list[dict[str, Any]]) -> None:
    for res in three_ranks:
        assert res["bitwise"]["equal"] and all(res["bitwise"]["equal"])
        assert res["bitwise"]["committed"] == [1, 2, 3]


def test_flipped_byte_caught_round_not_committed(three_ranks: list[dict[str, Any]]) -> None:
    holder_of_0 = compute_placement(3, 1, "ring").holders(0)[0]
    for r, res in enumerate(three_ranks):
        c = res["corrupt"]
        assert c["after_corrupt"] == 1 and not c["broken"] and c["still_has_v1"]
        assert c["after_recover"] == 3 and c["v1_released_v3_held"]
        assert (list(c["corrupt_seen"]) == ["0"]) == (r == holder_of_0)


def test_older_version_never_overwrites_newer(three_ranks: list[dict[str, Any]]) -> None:
    for res in three_ranks:
        assert res["corrupt"]["old_version"] == "StaleVersion"
        assert res["corrupt"]["newest_intact"]


def test_memory_flat_over_200_rounds(three_ranks: list[dict[str, Any]]) -> None:
    for res in three_ranks:
        m = res["memory"]
        assert m["committed"] == 200 and m["rounds"] == 200
        assert m["ptrs_stable"], "buffers were reallocated after warm-up"
        assert m["bytes_held"] == 2 * (256 << 10)
        assert m["rss_growth"] < 16 << 20, m["rss_growth"]


def test_stale_generation_and_job_rejected(tmp_path: Path) -> None:
    for res in spawn_scenarios(workers.worker, 2, ["stale"], tmp_path, 90):
        s = res["stale"]
        assert s["generation_stale"] and s["job_stale"], s
        assert s["generation_held"] == [] and s["job_held"] == []


def test_worker_module_is_importable_without_torch_distributed_init() -> None:
    assert callable(workers.worker) and os.path.basename(workers.__file__) == "mirror_workers.py"
