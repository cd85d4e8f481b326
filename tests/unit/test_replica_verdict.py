"""The replica check's verdict (ckptless/mirror/replica_verdict.py), over any pattern of corrupt copies.

The fault model (the module's doc): a copy goes wrong by a fault of one rank (a copy nobody else holds)
or of one node (the same wrong bytes in some or all of that node's replicas; in a set on one node
only rank faults, since there counting ranks is all the evidence there is). Properties, for any set
size, node layout, faults, abstaining ranks, tree shape and earlier replacements:

* it never names a good rank (REPLACE names only corrupt ones; STOP names nobody to replace);
* a version with any differing copy is never committed (some ring neighbours differ, so some rank
  does not acknowledge), and AGREE only when every compared copy is equal;
* with a proven majority it names exactly the corrupt ranks (when they are few enough to name);
* it always ends: the reduction over any tree gives every member the same verdict, and a rank or node
  replaced for corruption that shows it again stops the job (a persistent fault is replaced at most once).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.mirror import replica_check
from ckptless.mirror import replica_verdict as rv
from ckptless.mirror import tree
from ckptless.state.replication import Region, ReplicaSet

GOOD = 0


@dataclass(frozen=True)
class World:
    """One replica set: each member's node, copy (GOOD or a fault's) and whether it abstained."""

    nodes: tuple[int, ...]
    copies: tuple[int, ...]
    abstains: tuple[bool, ...]

    @property
    def size(self) -> int:
        return len(self.nodes)

    def leaves(self, strikes: tuple[rv.Strike, ...] = ()) -> list[rv.Evidence]:
        return [rv.leaf(r, self.nodes[r], None if self.abstains[r] else self.copies[r], (), strikes)
                for r in range(self.size)]

    def compared(self) -> list[int]:
        return [r for r in range(self.size) if not self.abstains[r]]


@st.composite
def worlds(draw: st.DrawFn, max_size: int = 12) -> World:
    n = draw(st.integers(2, max_size))
    n_nodes = draw(st.integers(1, min(n, 5)))
    nodes = tuple(draw(st.lists(st.integers(0, n_nodes - 1), min_size=n, max_size=n)))
    multi = len(set(nodes)) > 1
    bad_nodes = set(draw(st.lists(st.sampled_from(sorted(set(nodes))), max_size=3))) if multi else set()
    copies = []
    for r in range(n):
        c = GOOD
        if nodes[r] in bad_nodes and draw(st.booleans()):
            c = 1000 + nodes[r]  # the node's fault: the same wrong bytes on each rank it hits
        if draw(st.integers(0, 3)) == 0:
            c = 2000 + r  # the rank's own fault
        copies.append(c)
    abstains = tuple(draw(st.lists(st.integers(0, 5).map(lambda x: x == 0), min_size=n, max_size=n)))
    return World(nodes, tuple(copies), abstains)


def fold(leaves: list[rv.Evidence]) -> rv.Evidence:
    total = leaves[0]
    for e in leaves[1:]:
        total = rv.merge(total, e)
    return total


def tree_reduce(leaves: list[rv.Evidence], order: random.Random) -> rv.Evidence:
    """What gather() computes: each member merges its children's subtrees (in any order) into its own,
    through the wire encoding."""
    n = len(leaves)

    def up(i: int) -> rv.Evidence:
        kids = list(tree.children(i, n))
        order.shuffle(kids)
        total = leaves[i]
        for c in kids:
            total = rv.merge(rv.decode(rv.encode(up(c))), total) if order.random() < 0.5 else rv.merge(total, up(c))
        return total

    return rv.decode(rv.encode(up(0)))


@settings(max_examples=400, deadline=None)
@given(worlds(), st.randoms(use_true_random=False))
def test_never_names_a_good_rank_and_every_member_decides_alike(w: World, order: random.Random) -> None:
    leaves = w.leaves()
    v = rv.decide(tree_reduce(leaves, order))
    assert v == rv.decide(fold(leaves)) or v.evidence.dropped  # any tree shape, any order: the same verdict
    named = {r for r, _ in v.minority}
    if v.kind == "replace":
        for r in range(w.size):
            leaves_it = v.leaves(None if w.abstains[r] else w.copies[r])
            assert leaves_it == (r in named), (r, v)
            if leaves_it:
                assert w.copies[r] != GOOD, f"a good rank {r} named corrupt: {w}"
        assert v.proven is not None and v.proven.fp == GOOD
    compared = [w.copies[r] for r in w.compared()]
    if v.kind == "agree":
        assert len(set(compared)) <= 1


@settings(max_examples=300, deadline=None)
@given(worlds(max_size=10))
def test_a_proven_majority_names_exactly_the_corrupt_ranks(w: World) -> None:
    compared = w.compared()
    good = [r for r in compared if w.copies[r] == GOOD]
    bad = [r for r in compared if w.copies[r] != GOOD]
    multi = len(set(w.nodes)) > 1
    proven = 2 * len(good) > len(compared) and (not multi or len({w.nodes[r] for r in good}) > 1)
    distinct = {w.copies[r] for r in compared}
    v = rv.decide(fold(w.leaves()))
    if len(distinct) <= 1:
        assert v.kind == "agree"
    elif proven and len(bad) <= rv.MAX_RANKS and len(distinct) <= rv.MAX_COPIES:
        assert v.kind == "replace" and sorted(r for r, _ in v.minority) == bad, v
    else:
        assert v.kind == "stop" and not v.leaves(GOOD), v


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_a_version_with_any_differing_copy_is_never_committed(w: World) -> None:
    """The ring check finds every divergence: some member does not acknowledge (the version is never
    committed) and the commit agreement's flag starts the verdict; AGREE never covers a difference."""
    region = Region(4096, ReplicaSet.of_ranks(range(w.size)), False)
    sums = {r: [7, w.copies[r]] for r in range(w.size)}
    acks = []
    for r in range(w.size):
        prev, nxt = region.ranks.neighbours(r)
        if w.abstains[r]:
            acks.append(False)  # an abstaining rank never acknowledges
            continue
        differs = replica_check.compare(r, region, sums[r], None if w.abstains[prev] else sums[prev],
                                        None if w.abstains[nxt] else sums[nxt])
        acks.append(not differs)
    if len({w.copies[r] for r in range(w.size)}) > 1:
        assert not all(acks)


@settings(max_examples=200, deadline=None)
@given(worlds(max_size=9), st.lists(st.integers(0, 8), min_size=1, max_size=6))
def test_a_persistent_fault_is_replaced_at_most_once_then_the_job_stops(w: World, repeats: list[int]) -> None:
    """Rounds in which the same ranks keep showing their fault (a bad node, a bad device), the ranks
    that stay remembering each replacement: each rank and node is replaced for corruption at most once,
    so the sequence ends in a stop instead of a loop."""
    strikes: tuple[rv.Strike, ...] = ()
    replaced_ranks: set[int] = set()
    replaced_nodes: set[int] = set()
    stopped = False
    for version in range(1, 1 + len(repeats) + 1):
        v = rv.decide(fold(w.leaves(strikes)))
        if v.kind != "replace":
            stopped = v.kind == "stop"
            break
        for r, node in v.minority:
            assert r not in replaced_ranks and node not in replaced_nodes, (r, node, strikes)
        replaced_ranks |= {r for r, _ in v.minority}
        replaced_nodes |= {n for _, n in v.minority}
        strikes = rv._newest(strikes + tuple(rv.Strike(r, n, version) for r, n in v.minority))
    else:
        pytest.fail("a fault replaced in every round")
    assert stopped or len({w.copies[r] for r in w.compared()}) <= 1  # (else nothing compared differs)


def test_two_vs_two_on_one_node_is_a_tie_that_stops_naming_both_pairs() -> None:
    w = World((0, 0, 1, 1), (GOOD, GOOD, 1001, 1001), (False,) * 4)
    v = rv.decide(fold([rv.leaf(r, w.nodes[r], w.copies[r], (0,) if r in (1, 2) else ()) for r in range(4)]))
    assert v.kind == "stop" and v.why == "no_majority" and not v.minority
    text = rv.describe(v, 20, lambda i: "model.0.weight", lambda k: f"node{k}")
    assert "ranks 0, 1" in text and "ranks 2, 3 (all on node1)" in text and "model.0.weight" in text, text


def test_the_same_flip_on_ranks_1_and_3_names_nobody_odd() -> None:
    """Finding 9: each rank used to name itself the odd one (and all four left as failed hardware)."""
    w = World((0, 0, 1, 1), (GOOD, 1, GOOD, 1), (False,) * 4)
    v = rv.decide(fold(w.leaves()))
    assert v.kind == "stop" and not any(v.leaves(c) for c in w.copies)


def test_a_majority_confined_to_one_node_proves_nothing() -> None:
    """Node 0's three ranks agree, node 1's one rank does not: node 0's fault would look the same."""
    w = World((0, 0, 0, 1), (GOOD, GOOD, GOOD, 2003), (False,) * 4)
    v = rv.decide(fold(w.leaves()))
    assert v.kind == "stop" and v.why == "one_node"


def test_a_whole_bad_node_under_a_majority_on_two_nodes_is_replaced() -> None:
    w = World((0, 0, 1, 1, 2, 2), (GOOD, GOOD, GOOD, GOOD, 1002, 1002), (False,) * 6)
    v = rv.decide(fold(w.leaves()))
    assert v.kind == "replace" and v.minority == ((4, 2), (5, 2))
    text = rv.describe(v, 7, lambda i: f"t{i}", lambda k: f"node{k}")
    assert text.startswith("silent data corruption at step 7: ranks 4, 5 (on node2) are the odd ones"), text


def test_one_flipped_rank_of_four_is_replaced_and_named_with_the_tensor() -> None:
    w = World((0, 0, 1, 1), (GOOD, GOOD, 2002, GOOD), (False,) * 4)
    e = fold([rv.leaf(r, w.nodes[r], w.copies[r], (3,) if r in (1, 2, 3) else ()) for r in range(4)])
    v = rv.decide(e)
    assert v.kind == "replace" and v.minority == ((2, 1),)
    text = rv.describe(v, 5, lambda i: {3: "optimizer.state.0.exp_avg"}[i], lambda k: f"node{k}")
    assert "rank 2 (on node1) is the odd one" in text and "in optimizer.state.0.exp_avg" in text, text
    assert "ranks 0, 1, 3 hold (3 of 4, on several nodes)" in text, text


def test_a_rank_replaced_once_that_shows_it_again_stops_naming_it() -> None:
    w = World((0, 0, 1, 1), (GOOD, GOOD, 2002, GOOD), (False,) * 4)
    earlier = (rv.Strike(2, 1, 5),)
    v = rv.decide(fold([rv.leaf(r, w.nodes[r], w.copies[r], (), earlier if r != 2 else ()) for r in range(4)]))
    assert v.kind == "stop" and v.why == "again" and v.again == earlier
    text = rv.describe(v, 9, lambda i: "w", lambda k: f"node{k}")
    assert "rank 2 (on node1) is the odd one again" in text and "already replaced for corruption" in text, text
    assert "rank 2 on node1 at step 5" in text, text


def test_another_rank_of_a_node_already_replaced_stops_too() -> None:
    w = World((0, 0, 1, 1), (GOOD, GOOD, GOOD, 2003), (False,) * 4)
    v = rv.decide(fold([rv.leaf(r, w.nodes[r], w.copies[r], (), (rv.Strike(2, 1, 5),)) for r in range(4)]))
    assert v.kind == "stop" and v.why == "again"


def test_the_wire_round_trips_and_refuses_malformed_vectors() -> None:
    e = fold([rv.leaf(r, r % 3, 5 if r != 4 else 6, (r,), (rv.Strike(9, 1, 2),)) for r in range(10)])
    assert rv.decode(rv.encode(e)) == e
    with pytest.raises(ValueError):
        rv.decode(rv.encode(e)[:-1])
    bad = rv.encode(e)
    bad[0] += 1  # compared no longer adds up
    with pytest.raises(ValueError):
        rv.decode(bad)


def test_more_distinct_copies_than_kept_stop_and_never_replace() -> None:
    n = rv.MAX_COPIES + 4
    e = fold([rv.leaf(r, r, r) for r in range(n)])
    assert e.dropped > 0 and rv.decide(e).kind == "stop"


def test_fingerprints_tell_copies_apart_and_keys_fit_the_wire() -> None:
    a, b = rv.fingerprint([1, 2, 3]), rv.fingerprint([1, 2, 4])
    assert a != b and rv.fingerprint([1, 2, 3]) == a and rv.fingerprint([1, 2]) != rv.fingerprint([1, 2, 0])
    assert 0 <= a < 2**62 and 0 <= rv.node_key("node-a") < 2**62
