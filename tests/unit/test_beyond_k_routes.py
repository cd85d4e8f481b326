"""A rank and its only holder killed together (K = 1, node-local tier on): which memory route each takes.

The facts of tests/e2e/test_recovery_e2e.py::test_more_than_k_failures_in_one_group_fall_back_to_disk
as its agents and survivors reported them (read from etcd in runs on a 2-core machine): ranks 0 and 2
of 4 (nodes a: 0, 1; b: 2, 3; ring placement 0->2, 1->3, 2->1, 3->0) SIGKILLed in step 7, while the
mirror round of v7 runs beside them. Where the kills land in that round decides the facts, and the facts
decide the routes; the e2e test once asserted one of them and failed about 1 run in 5. Here each kind
of facts gives one plan, whatever order its facts come in, and every route is a memory one.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.recovery import PlanningFacts, PlanPolicy, RankSlot, RecoveryPlan, ReplicaFact, Worker, WorkerReport
from ckptless.recovery.facts import NodeLocalCopy, NodeLocalImage
from ckptless.recovery.plan import plan_recovery

from ..harness.routes import memory_routes

NODE = {0: "a", 1: "a", 2: "b", 3: "b"}
HOLDERS = {0: (2,), 1: (3,), 2: (1,), 3: (0,)}  # tests/harness/cluster.py ring_holders()
LOST = (0, 2)


def _facts(committed: int, own: int, replicas: tuple[int, ...], newest: int = 7,
           policy: PlanPolicy = PlanPolicy()) -> PlanningFacts:
    """``committed``: what the survivors learned; ``own``: the version of both dead ranks' own images in
    their nodes' memory (written at the commit each had seen); ``replicas``: the versions every holder
    held of its owners (the dead ones' in their node's memory, the live ones' in theirs)."""
    members = tuple(RankSlot(r, Worker(f"{NODE[r]}/w{r}", NODE[r]), r not in LOST) for r in range(4))
    reports = tuple(
        WorkerReport(f"{NODE[r]}/w{r}", newest, committed, frozenset(range(committed, newest + 1)),
                     tuple(ReplicaFact(o, v, 1) for o, hs in sorted(HOLDERS.items()) if r in hs for v in replicas))
        for r in range(4) if r not in LOST)
    node_local = tuple(NodeLocalImage(r, NODE[r], own, 1) for r in LOST)
    copies = tuple(NodeLocalCopy(r, r, NODE[r], own, 1) for r in LOST) + tuple(
        NodeLocalCopy(o, r, NODE[r], v, 1) for r in LOST for o, hs in sorted(HOLDERS.items()) if r in hs
        for v in replicas)
    return PlanningFacts("job", 0, 4, members, reports, placement=HOLDERS, snapshot_step=6, policy=policy,
                         node_local=node_local, node_copies=copies)


# (facts, resume version, routes): the round of v7 not sent yet (5 of 8 runs), sent everywhere but not
# agreed (1 of 8: the e2e failure, rank 2 from rank 1's replica), agreed (2 of 8).
CASES = {
    "before-v7-sent": (_facts(6, 6, (5, 6)), 6, {0: ["R9"], 2: ["R9"]}),
    "v7-sent-not-agreed": (_facts(6, 6, (6, 7)), 7, {0: ["R11"], 2: ["peer"]}),
    "v7-sent-not-agreed-capped": (_facts(6, 6, (6, 7), policy=PlanPolicy(resume_beyond_committed=False)), 6,
                                  {0: ["R9"], 2: ["R9"]}),
    "v7-agreed": (_facts(7, 7, (6, 7)), 7, {0: ["R9"], 2: ["R9"]}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_lost_rank_comes_from_a_live_nodes_memory(name: str) -> None:
    facts, version, routes = CASES[name]
    d = plan_recovery(facts)
    assert isinstance(d, RecoveryPlan), d
    assert d.resume_version == version and d.lost_ranks == LOST
    assert memory_routes(d) == routes, d


def test_sent_not_agreed_rank_0_is_served_by_the_survivor_on_its_holders_node() -> None:
    """v7 of rank 0 is only in the copy its dead holder (rank 2) left on node b: rank 3 adopts it and
    sends it; rank 2's v7 is in rank 1's memory, so rank 1 sends it (its own node only has v6)."""
    d = plan_recovery(CASES["v7-sent-not-agreed"][0])
    assert isinstance(d, RecoveryPlan)
    assert [(x.worker_id, x.owner, x.holder, x.node_id, x.version) for x in d.adoptions] == [("b/w3", 0, 2, "b", 7)]
    assert [(t.owner, t.holders) for t in d.transfers] == [(0, ("b/w3",)), (2, ("a/w1",))]
    assert d.node_local == () and d.steps_lost == 0


def test_a_route_through_a_dead_worker_or_another_version_is_none() -> None:
    """The helper the e2e test asserts with: a transfer from the dead holder, or of another version
    than the plan's, is no memory route (what it would say of a wrong plan)."""
    d = plan_recovery(CASES["v7-sent-not-agreed"][0])
    assert isinstance(d, RecoveryPlan)
    from_dead = tuple(replace(t, holders=("b/w2",), stripes=tuple(replace(s, source="b/w2") for s in t.stripes))
                      if t.owner == 2 else t for t in d.transfers)
    assert memory_routes(replace(d, transfers=from_dead)) == {0: ["R11"], 2: []}
    older = tuple(replace(t, version=6) for t in d.transfers)
    assert memory_routes(replace(d, transfers=older)) == {0: [], 2: []}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.integers(0, 2**32))
def test_the_route_depends_on_the_facts_not_the_order_they_arrive_in(name: str, seed: int) -> None:
    """What the leader reads in another order (reports, exit records' images and copies) plans the same."""
    facts = CASES[name][0]
    rnd = random.Random(seed)

    def shuffled(xs: tuple) -> tuple:
        out = list(xs)
        rnd.shuffle(out)
        return tuple(out)

    g = replace(facts, members=shuffled(facts.members), reports=shuffled(facts.reports),
                node_local=shuffled(facts.node_local), node_copies=shuffled(facts.node_copies))
    assert plan_recovery(g) == plan_recovery(facts)
