"""Which peers a user group's formation connects (ckptless/worker/gloo_peers.py ``collective_peers``).

The tables are what torch 2.13's Gloo looked up, per rank, for each collective on a fresh lazily
connected group of W = 8 and W = 12 processes (2026-11-29, issue 35: the ranks each one's store
lookups named). The formation must connect exactly their union: a pair it leaves out opens in the
user's first step (where a dead peer costs Gloo's connect timeout), and one it adds is a socket for
nothing. tests/e2e/test_lazy_user_gloo.py checks the same on live groups (no lookup after the
formation)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptless.worker.gloo_peers import collective_peers

BARRIER = {
    8: {0: [1, 2, 4, 6, 7], 1: [0, 2, 3, 5, 7], 2: [0, 1, 3, 4, 6], 3: [1, 2, 4, 5, 7], 4: [0, 2, 3, 5, 6],
        5: [1, 3, 4, 6, 7], 6: [0, 2, 4, 5, 7], 7: [0, 1, 3, 5, 6]},
    12: {0: [1, 2, 4, 8, 10, 11], 1: [0, 2, 3, 5, 9, 11], 2: [0, 1, 3, 4, 6, 10], 3: [1, 2, 4, 5, 7, 11],
         4: [0, 2, 3, 5, 6, 8], 5: [1, 3, 4, 6, 7, 9], 6: [2, 4, 5, 7, 8, 10], 7: [3, 5, 6, 8, 9, 11],
         8: [0, 4, 6, 7, 9, 10], 9: [1, 5, 7, 8, 10, 11], 10: [0, 2, 6, 8, 9, 11], 11: [0, 1, 3, 7, 9, 10]},
}
BROADCAST_FROM_0 = {
    8: {0: [1, 2, 4], 1: [0, 3, 5], 2: [0, 6], 3: [1, 7], 4: [0], 5: [1], 6: [2], 7: [3]},
    12: {0: [1, 2, 4, 8], 1: [0, 3, 5, 9], 2: [0, 6, 10], 3: [1, 7, 11], 4: [0], 5: [1], 6: [2], 7: [3], 8: [0],
         9: [1], 10: [2], 11: [3]},
}


@pytest.mark.parametrize("world", [8, 12])
def test_the_union_of_what_gloo_looked_up(world: int) -> None:
    for rank in range(world):
        ring = {(rank + 1) % world, (rank - 1) % world}  # allreduce, 1 element and 4 MiB alike
        want = sorted(set(BARRIER[world][rank]) | set(BROADCAST_FROM_0[world][rank]) | ring)
        assert collective_peers(rank, world) == want, rank


@given(st.integers(1, 300).flatmap(lambda w: st.tuples(st.just(w), st.integers(0, w - 1))))
def test_symmetric_small_and_never_itself(case: tuple[int, int]) -> None:
    world, rank = case
    peers = collective_peers(rank, world)
    assert rank not in peers and all(0 <= p < world for p in peers)
    assert all(rank in collective_peers(p, world) for p in peers)  # one message each way pairs them up
    assert len(peers) <= 3 * max(1, world.bit_length()) + 2  # O(log W), not W


def test_tiny_worlds() -> None:
    assert collective_peers(0, 1) == []
    assert collective_peers(0, 2) == [1] and collective_peers(1, 2) == [0]
