"""The replica check's verdict (ckptless/mirror/replica_verdict.py), over any pattern of corrupt copies.

The fault model (the module's doc): a copy goes wrong by a fault of one rank (a copy nobody else holds)
or of one node (the same wrong bytes in any number of that node's replicas, all of them included, in a
set on one node too). Properties, for any set size, node layout, faults, abstaining ranks, placement
of mirror holders, tree shape and earlier replacements:

* it never names a good rank (REPLACE names only corrupt ones; STOP and DEFER name nobody to replace),
  in a set on one node too (there it never replaces: counting ranks proves nothing);
* a REPLACE never takes out a rank together with all of its mirror holders;
* a version with any differing copy is never committed (some ring neighbours differ, so some rank
  does not acknowledge), and AGREE only when every compared copy is equal;
* with a proven majority it names exactly the corrupt ranks (when they are few enough to name and
  replacing them leaves every rank's state somewhere);
* it always ends: the reduction over any tree gives every member the same verdict, a rank or node
  replaced for corruption that shows it again stops the job (a persistent fault is replaced at most
  once), and an undecided round is deferred at most once in a row.
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
from ckptless.mirror.placement import compute_placement
from ckptless.state.replication import Region, ReplicaSet

GOOD = 0


@dataclass(frozen=True)
class World:
    """One replica set (the whole world): each member's node, copy (GOOD or a fault's), whether it
    abstained, and its mirror holders (the placement)."""

    nodes: tuple[int, ...]
    copies: tuple[int, ...]
    abstains: tuple[bool, ...]
    holders_of: tuple[tuple[int, ...], ...] = ()

    @property
    def size(self) -> int:
        return len(self.nodes)

    def holders(self, rank: int) -> tuple[int, ...]:
        return self.holders_of[rank] if self.holders_of else ((rank + 1) % self.size,)

    def leaves(self, strikes: tuple[rv.Strike, ...] = (), deferred: frozenset[int] = frozenset()) -> list[rv.Evidence]:
        return [rv.leaf(r, self.nodes[r], None if self.abstains[r] else self.copies[r], (), strikes, r in deferred)
                for r in range(self.size)]

    def compared(self) -> list[int]:
        return [r for r in range(self.size) if not self.abstains[r]]

    def decide(self, e: rv.Evidence) -> rv.Verdict:
        return rv.decide(e, self.holders)


@st.composite
def placements(draw: st.DrawFn, nodes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The placement's holders of each rank: ckptless's own (any strategy, K) or any K distinct others."""
    n = len(nodes)
    k = draw(st.integers(1, min(3, n - 1)))
    if draw(st.booleans()):
        strategy = draw(st.sampled_from(["ring", "group", "mixed"]))
        return compute_placement(n, k, strategy, [f"n{x}" for x in nodes]).holders_of
    return tuple(tuple(draw(st.lists(st.sampled_from([h for h in range(n) if h != o]), min_size=k, max_size=k,
                                     unique=True))) for o in range(n))


@st.composite
def worlds(draw: st.DrawFn, max_size: int = 12) -> World:
    n = draw(st.integers(2, max_size))
    n_nodes = draw(st.integers(1, min(n, 5)))
    nodes = tuple(draw(st.lists(st.integers(0, n_nodes - 1), min_size=n, max_size=n)))
    bad_nodes = set(draw(st.lists(st.sampled_from(sorted(set(nodes))), max_size=3)))  # a one-node set's too
    everywhere = draw(st.booleans())  # a node fault may hit every replica it holds, or some
    copies = []
    for r in range(n):
        c = GOOD
        if nodes[r] in bad_nodes and (everywhere or draw(st.booleans())):
            c = 1000 + nodes[r]  # the node's fault: the same wrong bytes on each rank it hits
        if draw(st.integers(0, 3)) == 0:
            c = 2000 + r  # the rank's own fault
        copies.append(c)
    abstains = tuple(draw(st.lists(st.integers(0, 5).map(lambda x: x == 0), min_size=n, max_size=n)))
    return World(nodes, tuple(copies), abstains, draw(placements(nodes)))


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


@settings(max_examples=500, deadline=None)
@given(worlds(), st.randoms(use_true_random=False), st.frozensets(st.integers(0, 11)))
def test_never_names_a_good_rank_nor_takes_out_a_rank_with_its_holders(w: World, order: random.Random,
                                                                     deferred: frozenset[int]) -> None:
    leaves = w.leaves(deferred=deferred)
    v = w.decide(tree_reduce(leaves, order))
    assert v == w.decide(fold(leaves)) or v.evidence.dropped  # any tree shape, any order: the same verdict
    named = {r for r, _ in v.minority}
    if v.kind == "replace":
        for r in range(w.size):
            leaves_it = v.leaves(None if w.abstains[r] else w.copies[r])
            assert leaves_it == (r in named), (r, v)
            if leaves_it:
                assert w.copies[r] != GOOD, f"a good rank {r} named corrupt: {w}"
        assert v.proven is not None and v.proven.fp == GOOD
        for r in named:  # every rank leaving keeps a holder that stays: its private state survives
            assert not set(w.holders(r)) <= named, f"rank {r} would leave with all its holders {w.holders(r)}"
        assert len(set(w.nodes)) > 1, "a set on one node replaced a rank"
    else:
        assert not any(v.leaves(c) for c in w.copies)
    if v.proven is not None:
        assert v.proven.fp == GOOD and v.proven_right(GOOD)  # proven means proven: never an unproven copy
    compared = [w.copies[r] for r in w.compared()]
    if v.kind == "agree":
        assert len(set(compared)) <= 1
    if v.kind == "defer":
        assert any(w.abstains) and not v.evidence.deferred and not v.proven


@settings(max_examples=400, deadline=None)
@given(worlds(max_size=10))
def test_a_proven_majority_names_exactly_the_corrupt_ranks(w: World) -> None:
    compared = w.compared()
    good = [r for r in compared if w.copies[r] == GOOD]
    bad = [r for r in compared if w.copies[r] != GOOD]
    proven = 2 * len(good) > len(compared) and len({w.nodes[r] for r in good}) > 1
    distinct = {w.copies[r] for r in compared}
    orphan = any(set(w.holders(r)) <= set(bad) for r in bad)
    v = w.decide(fold(w.leaves()))
    if len(distinct) <= 1:
        assert v.kind == "agree"
    elif proven and len(bad) <= rv.MAX_RANKS and len(distinct) <= rv.MAX_COPIES and not orphan:
        assert v.kind == "replace" and sorted(r for r, _ in v.minority) == bad, v
    elif proven and len(bad) <= rv.MAX_RANKS and len(distinct) <= rv.MAX_COPIES:
        assert v.kind == "stop" and v.why in ("holders", "again"), v
    elif len(set(w.nodes)) == 1:
        assert v.kind == "stop" and v.why == "single_node", v
    elif not proven and len(distinct) <= rv.MAX_COPIES:
        best = max(sum(1 for r in compared if w.copies[r] == c) for c in distinct)
        n_abs = w.size - len(compared)
        could = n_abs > 0 and 2 * (best + n_abs) > len(compared) + n_abs
        assert v.kind == ("defer" if could else "stop") and not v.leaves(GOOD), v
    else:
        assert v.kind in ("stop", "defer") and not v.leaves(GOOD), v


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


@settings(max_examples=300, deadline=None)
@given(worlds(max_size=9), st.lists(st.tuples(st.lists(st.booleans(), min_size=9, max_size=9),
                                              st.frozensets(st.integers(0, 8), min_size=1)), min_size=1, max_size=6))
def test_a_persistent_fault_is_replaced_at_most_once_and_deferred_at_most_once_in_a_row(
        w: World, rounds: list[tuple[list[bool], frozenset[int]]]) -> None:
    """Rounds in which the same ranks keep showing their fault (a bad node, a bad device), other ranks
    abstaining in each, the ranks that stay remembering each replacement and some members (those that
    saw it: a replacement does not) remembering a deferral: each rank and node is replaced for
    corruption at most once and no two rounds in a row are deferred, so the sequence ends in a stop
    instead of a loop."""
    strikes: tuple[rv.Strike, ...] = ()
    replaced_ranks: set[int] = set()
    replaced_nodes: set[int] = set()
    stopped, deferred_before = False, False
    for version, (abstains, remember) in enumerate(rounds + [(list(w.abstains), frozenset(range(9)))], start=1):
        now = World(w.nodes, w.copies, tuple(abstains[: w.size]), w.holders_of)
        memory = frozenset(x % w.size for x in remember) if deferred_before else frozenset()
        v = now.decide(fold(now.leaves(strikes, memory)))
        if v.kind == "defer":
            assert not deferred_before, "two rounds in a row deferred"
            deferred_before = True
            continue
        deferred_before = False
        if v.kind != "replace":
            stopped = v.kind == "stop"
            break
        for r, node in v.minority:
            assert r not in replaced_ranks and node not in replaced_nodes, (r, node, strikes)
        replaced_ranks |= {r for r, _ in v.minority}
        replaced_nodes |= {n for _, n in v.minority}
        strikes = rv._newest(strikes + tuple(rv.Strike(r, n, version) for r, n in v.minority))
    else:
        assert deferred_before or replaced_ranks, "rounds ended with neither a replacement nor a deferral"
        return
    assert stopped or v.kind == "agree"


def test_two_vs_two_on_one_node_is_a_tie_that_stops_naming_both_pairs() -> None:
    w = World((0, 0, 1, 1), (GOOD, GOOD, 1001, 1001), (False,) * 4)
    v = w.decide(fold([rv.leaf(r, w.nodes[r], w.copies[r], (0,) if r in (1, 2) else ()) for r in range(4)]))
    assert v.kind == "stop" and v.why == "no_majority" and not v.minority
    text = rv.describe(v, 20, lambda i: "model.0.weight", lambda k: f"node{k}")
    assert "ranks 0, 1" in text and "ranks 2, 3 (all on node1)" in text and "model.0.weight" in text, text


def test_the_same_flip_on_ranks_1_and_3_names_nobody_odd() -> None:
    """Finding 9: each rank used to name itself the odd one (and all four left as failed hardware)."""
    w = World((0, 0, 1, 1), (GOOD, 1, GOOD, 1), (False,) * 4)
    v = w.decide(fold(w.leaves()))
    assert v.kind == "stop" and not any(v.leaves(c) for c in w.copies)


def test_a_rank_is_never_replaced_together_with_all_its_holders() -> None:
    """A review's case: K = 1, a node fault on ranks 2 and 3 of a 6-rank set over 3 nodes, under a
    placement where rank 3 is rank 2's only holder (here: no node layout given to it). Replacing both
    would leave rank 2's private state (RNG, data position) in no process: the job stops, naming the
    ranks, the tensor and why."""
    nodes = (0, 0, 1, 1, 2, 2)
    w = World(nodes, (GOOD, GOOD, 1001, 1001, GOOD, GOOD), (False,) * 6,
              compute_placement(6, 1, "ring", None).holders_of)  # r -> r + 1
    v = w.decide(fold([rv.leaf(r, nodes[r], w.copies[r], (4,) if r in (1, 2, 3, 4) else ()) for r in range(6)]))
    assert v.kind == "stop" and v.why == "holders" and v.orphans == ((2, (3,)),) and not v.leaves(1001), v
    text = rv.describe(v, 20, lambda i: {4: "optimizer.state.1.exp_avg_sq"}[i], lambda k: f"node{k}")
    assert text.startswith("silent data corruption at step 20: ranks 2, 3 (on node1) are the odd ones"), text
    assert "in optimizer.state.1.exp_avg_sq" in text and "rank 2 with its only holder rank 3" in text, text
    assert "nothing could rebuild it: the job stops" in text, text
    # ckptless's own node-aware placement puts rank 2's holder on another node: both are replaced
    w2 = World(nodes, w.copies, w.abstains, _ring(nodes))
    assert w2.decide(fold(w2.leaves())).kind == "replace"
    # K = 2 with one holder off the bad node: replaced
    w3 = World(nodes, w.copies, w.abstains, tuple(((r + 1) % 6, (r + 3) % 6) for r in range(6)))
    assert w3.decide(fold(w3.leaves())).kind == "replace"


def test_a_set_on_one_node_never_replaces_whatever_the_count() -> None:
    """A node fault that writes the same bytes into three of four replicas on one node makes the one
    good rank the minority: counting ranks would name it. So no copy is proven on one node: a single
    flipped rank of a one-node set stops too (docs/failure-model.md, "Whose copy is right")."""
    node_fault = World((0,) * 4, (1000, 1000, GOOD, 1000), (False,) * 4)
    one_flip = World((0,) * 4, (GOOD, GOOD, 2002, GOOD), (False,) * 4)
    for w in (node_fault, one_flip):
        v = w.decide(fold(w.leaves()))
        assert v.kind == "stop" and v.why == "single_node" and v.proven is None and not v.minority, v
        assert not any(v.leaves(c) for c in w.copies)
    text = rv.describe(w.decide(fold(node_fault.leaves())), 9, lambda i: "w", lambda k: "gpu-box")
    assert "ranks 0, 1, 3 (all on gpu-box) hold one copy, rank 2 (on gpu-box) hold another" in text, text
    assert "Every replica runs on gpu-box" in text and "counting ranks proves no copy right" in text, text


def test_an_abstaining_rank_defers_a_one_against_one_once() -> None:
    """A set of three, one abstaining (its live prefix moved under the read), one flipped: 1 vs 1 proves
    nothing, but the abstainer's copy could; the verdict waits one round, naming nobody. A round after
    one deferred that is still undecided stops."""
    w = World((0, 1, 2), (GOOD, GOOD, 2002), (True, False, False))
    v = w.decide(fold(w.leaves()))
    assert v.kind == "defer" and v.why == "no_majority" and not v.minority and v.proven is None, v
    text = rv.describe(v, 6, lambda i: "w", lambda k: f"node{k}")
    assert text.startswith("replica mismatch at step 6, undecided:") and "the next round decides" in text, text
    again = w.decide(fold(w.leaves(deferred=frozenset({1}))))
    assert again.kind == "stop" and again.why == "no_majority", again
    assert "the previous round was deferred" in rv.describe(again, 7, lambda i: "w", lambda k: f"node{k}")
    # the next round's evidence (nobody abstains) decides: rank 2 is replaced
    nxt = World(w.nodes, w.copies, (False,) * 3)
    assert nxt.decide(fold(nxt.leaves(deferred=frozenset({0, 1, 2})))).kind == "replace"
    # abstainers too few to make a majority: no point waiting
    few = World((0, 1, 2, 3, 4), (GOOD, GOOD, 2002, 2003, 2004), (True, False, False, False, False))
    assert few.decide(fold(few.leaves())).kind == "stop"


def test_a_majority_confined_to_one_node_proves_nothing() -> None:
    """Node 0's three ranks agree, node 1's one rank does not: node 0's fault would look the same."""
    w = World((0, 0, 0, 1), (GOOD, GOOD, GOOD, 2003), (False,) * 4)
    v = w.decide(fold(w.leaves()))
    assert v.kind == "stop" and v.why == "one_node"


def _ring(nodes: tuple[int, ...], k: int = 1) -> tuple[tuple[int, ...], ...]:
    return compute_placement(len(nodes), k, "ring", [f"node{x}" for x in nodes]).holders_of


def test_a_whole_bad_node_under_a_majority_on_two_nodes_is_replaced() -> None:
    nodes = (0, 0, 1, 1, 2, 2)
    w = World(nodes, (GOOD, GOOD, GOOD, GOOD, 1002, 1002), (False,) * 6, _ring(nodes))  # 4 -> 1, 5 -> 0
    v = w.decide(fold(w.leaves()))
    assert v.kind == "replace" and v.minority == ((4, 2), (5, 2))
    text = rv.describe(v, 7, lambda i: f"t{i}", lambda k: f"node{k}")
    assert text.startswith("silent data corruption at step 7: ranks 4, 5 (on node2) are the odd ones"), text


def test_one_flipped_rank_of_four_is_replaced_and_named_with_the_tensor() -> None:
    w = World((0, 0, 1, 1), (GOOD, GOOD, 2002, GOOD), (False,) * 4)
    e = fold([rv.leaf(r, w.nodes[r], w.copies[r], (3,) if r in (1, 2, 3) else ()) for r in range(4)])
    v = w.decide(e)
    assert v.kind == "replace" and v.minority == ((2, 1),)
    text = rv.describe(v, 5, lambda i: {3: "optimizer.state.0.exp_avg"}[i], lambda k: f"node{k}")
    assert "rank 2 (on node1) is the odd one" in text and "in optimizer.state.0.exp_avg" in text, text
    assert "ranks 0, 1, 3 hold (3 of 4, on several nodes)" in text, text


def test_a_rank_replaced_once_that_shows_it_again_stops_naming_it() -> None:
    w = World((0, 0, 1, 1), (GOOD, GOOD, 2002, GOOD), (False,) * 4)
    earlier = (rv.Strike(2, 1, 5),)
    v = w.decide(fold([rv.leaf(r, w.nodes[r], w.copies[r], (), earlier if r != 2 else ()) for r in range(4)]))
    assert v.kind == "stop" and v.why == "again" and v.again == earlier
    text = rv.describe(v, 9, lambda i: "w", lambda k: f"node{k}")
    assert "rank 2 (on node1) is the odd one again" in text and "already replaced for corruption" in text, text
    assert "rank 2 on node1 at step 5" in text, text


def test_another_rank_of_a_node_already_replaced_stops_too() -> None:
    w = World((0, 0, 1, 1), (GOOD, GOOD, GOOD, 2003), (False,) * 4)
    v = w.decide(fold([rv.leaf(r, w.nodes[r], w.copies[r], (), (rv.Strike(2, 1, 5),)) for r in range(4)]))
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
    assert e.dropped > 0 and rv.decide(e, lambda r: ((r + 1) % n,)).kind == "stop"


def test_fingerprints_tell_copies_apart_and_keys_fit_the_wire() -> None:
    a, b = rv.fingerprint([1, 2, 3]), rv.fingerprint([1, 2, 4])
    assert a != b and rv.fingerprint([1, 2, 3]) == a and rv.fingerprint([1, 2]) != rv.fingerprint([1, 2, 0])
    assert 0 <= a < 2**62 and 0 <= rv.node_key("node-a") < 2**62
