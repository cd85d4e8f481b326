"""The agreement tree and the mirror group's peer sets (pure; issue 20)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.mirror import tree
from ckptless.mirror.placement import compute_placement
from ckptless.recovery.decision import Assignment, RecoveryPlan, Stripe, Transfer
from ckptless.recovery.wire import Membership
from ckptless.worker.mirror_peers import mirror_peers, node_of


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20_000), st.integers(2, 8))
def test_tree_is_one_tree_with_bounded_degree_and_log_depth(world: int, fanout: int) -> None:
    ranks = range(world) if world <= 300 else [0, 1, world // 2, world - 2, world - 1]
    for r in ranks:
        up = tree.parent(r, fanout)
        assert (up is None) == (r == 0)
        if up is not None:
            assert r in tree.children(up, world, fanout)
        for c in tree.children(r, world, fanout):
            assert tree.parent(c, fanout) == r
        assert len(tree.neighbours(r, world, fanout)) <= fanout + 1
    want, full = 0, 1  # the smallest depth whose complete tree (1 + f + ... + f^d ranks) holds the world
    while full < world:
        want += 1
        full += fanout ** want
    assert tree.depth(world, fanout) == want
    assert want <= math.log(max(world, 1), fanout) + 1


def _membership(world: int, nodes: int, plan: RecoveryPlan | None) -> Membership:
    return Membership(1, world, "h", 1, tuple(Assignment(r, f"w{r}", f"n{r % nodes}", "survivor")
                                              for r in range(world)), plan)


@settings(max_examples=120, deadline=None)
@given(st.integers(2, 64), st.integers(1, 3), st.integers(1, 8), st.sampled_from(["ring", "group", "mixed"]),
       st.data())
def test_peer_sets_are_symmetric_and_small(world: int, k: int, nodes: int, strategy: str, data: st.DataObject) -> None:
    k = min(k, world - 1)
    owner = data.draw(st.integers(0, world - 1))
    sources = data.draw(st.lists(st.integers(0, world - 1).filter(lambda r: r != owner), min_size=1, max_size=3))
    stripes = tuple(Stripe(owner, i, i + 1, f"w{s}", tuple(f"w{x}" for x in sources if x != s))
                    for i, s in enumerate(sources))
    transfer = Transfer(owner, f"w{owner}", 5, len(stripes), tuple(f"w{s}" for s in sources), stripes)
    plan = RecoveryPlan("job", 1, (), (owner,), 5, (), (transfer,), False, (), 0)
    m = _membership(world, nodes, plan)
    placement = compute_placement(world, k, strategy, node_of(m))
    peers = {r: set(mirror_peers(m, r, k, strategy)) for r in range(world)}
    for r, ps in peers.items():
        assert r not in ps
        for p in ps:
            assert r in peers[p], f"{r} connects to {p} but not the other way"
        extra = len(sources) if r == owner else 1
        assert len(ps) <= k + max(placement.loads()) + tree.FANOUT + 1 + extra


def test_node_of_is_rank_ordered() -> None:
    m = Membership(0, 3, "h", 1, (Assignment(2, "c", "z", "survivor"), Assignment(0, "a", "x", "survivor"),
                                  Assignment(1, "b", "y", "survivor")))
    assert node_of(m) == ["x", "y", "z"]
