"""R10, going on with fewer ranks: which survivor hosts which lost rank (pure; issue 22).

Over the planner's random worlds (tests/harness/plan_worlds.py), with every
survivor able to host: the ``shrink`` policy changes a plan only where ``wait``
would wait with every rank's image in memory, and then either hosts every lost
rank (the processes are the survivors), each by a live holder of its image at the resume
version, the load spread within one rank, or waits saying why not. The membership
record of such a plan round-trips, and it names each process's place among the
processes (what the worker's communicators are built over).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import event, given

from ckptless.recovery import PlanPolicy, RecoveryPlan, Unrecoverable, WaitForReplacement, plan_recovery
from ckptless.recovery.shrink import host_lost_ranks
from ckptless.recovery.wire import Membership, membership_from_json, membership_to_json

from ..harness.plan_worlds import SETTINGS, World, example_facts, worlds


def _shrinking(world: World, min_nodes: int = 1, can_host: bool = True):
    f = world.facts
    reports = tuple(replace(r, can_host=can_host) for r in f.reports)
    return replace(f, reports=reports, policy=replace(f.policy, lost_node="shrink", min_nodes=min_nodes))


@SETTINGS
@given(worlds())
def test_shrink_hosts_exactly_the_ranks_a_wait_would_wait_for(world: World) -> None:
    waiting = plan_recovery(world.facts)
    f = _shrinking(world)
    d = plan_recovery(f)
    if not (isinstance(waiting, WaitForReplacement) and waiting.then == "memory"):
        assert d == waiting, "shrink changes nothing but a wait with every image in memory"
        return
    event(type(d).__name__)
    if isinstance(d, WaitForReplacement):
        assert "not going on with fewer ranks" in d.reason
        return
    assert isinstance(d, RecoveryPlan)
    hosted = {a.rank: a for a in d.assignments if a.source == "hosted"}
    assert sorted(hosted) == sorted(f.lost_ranks), "every lost rank: the processes are the survivors"
    assert all(a.source in ("survivor", "hosted") for a in d.assignments)
    assert [a.rank for a in d.assignments] == list(range(f.world_size))
    live = {s.worker.worker_id: s.rank for s in f.members if s.alive}
    for rank, a in hosted.items():
        assert a.worker_id in live, "a host is a survivor"
        rep = f.report_of(a.worker_id)
        assert rep is not None and d.resume_version in rep.local_versions
        assert any(x.owner == rank and x.version == d.resume_version for x in rep.replicas), \
            "the host holds the rank's image of the resume version"
        assert all(t.owner != rank for t in d.transfers), "nothing moves for a hosted rank"
    load = Counter(a.worker_id for a in hosted.values())
    for rank, a in hosted.items():  # no other holder of this rank was left with fewer ranks to host
        holders = [w for w, r in live.items()
                   if any(x.owner == rank and x.version == d.resume_version
                          for x in (f.report_of(w).replicas if f.report_of(w) else ()))
                   and d.resume_version in f.report_of(w).local_versions]  # type: ignore[union-attr]
        assert load[a.worker_id] <= min(load[w] for w in holders) + 1
    m = Membership(d.generation, f.world_size, "h", 1, d.assignments, d)
    back = membership_from_json(membership_to_json(m))
    assert back.hosted == {r: a.worker_id for r, a in hosted.items()}
    processes = sorted(live, key=lambda w: live[w])
    for i, w in enumerate(processes):
        assert back.rank_of(w) == live[w], "a host's rank is its own, never a hosted one"
        assert back.physical(w) == (i, len(processes))
        assert back.hosted_by(w) == sorted(r for r, a in hosted.items() if a.worker_id == w)


@SETTINGS
@given(worlds())
def test_no_shrink_below_min_nodes_or_without_hosts(world: World) -> None:
    waiting = plan_recovery(world.facts)
    if not (isinstance(waiting, WaitForReplacement) and waiting.then == "memory"):
        return
    nodes = {s.worker.node_id for s in world.facts.members if s.alive}
    too_few = plan_recovery(_shrinking(world, min_nodes=len(nodes) + 1))
    assert isinstance(too_few, WaitForReplacement) and "--nnodes minimum" in too_few.reason
    not_ddp = plan_recovery(_shrinking(world, can_host=False))
    assert isinstance(not_ddp, WaitForReplacement) and "cannot run another rank's micro-batches" in not_ddp.reason


def test_worked_example_rank_that_cannot_respawn() -> None:
    """docs/recovery.md's example: rank 1 lost, no spare, its node cannot start it again (its GPU failed).
    ``wait`` waits; ``shrink`` has rank 2, the holder of rank 1's image of v100, host it."""
    f = replace(example_facts(snapshot=None), no_respawn=frozenset({1}))
    assert isinstance(plan_recovery(f), WaitForReplacement)
    f = replace(f, reports=tuple(replace(r, can_host=True) for r in f.reports), policy=PlanPolicy(lost_node="shrink"))
    d = plan_recovery(f)
    assert isinstance(d, RecoveryPlan), d
    assert d.hosted == {1: "b/w2"} and d.resume_version == 100 and d.transfers == ()
    assert host_lost_ranks(replace(f, policy=PlanPolicy()), d.assignments, 100, {}) == (
        [], [], "the job waits for a replacement (--lost-node wait)")


# --- issue 35, finding 1: a further loss while the job runs with fewer ranks ------------------------------
def _shrunk_world(kill_host: bool = True):
    """2 nodes x 2, K = 1 (0<-2, 1<-3, 2<-1, 3<-0), node n1 lost at v4 with no spare: generation 1 runs ranks
    0 and 1 on n0, rank 0 hosting 3 and rank 1 hosting 2 (the holders of their images). Then rank 1, a
    host, is SIGKILLed: its agent finds its own image and its copy of rank 2's on n0 and says so."""
    from ckptless.recovery.decision import Assignment
    from ckptless.recovery.facts import NodeLocalCopy, NodeLocalImage

    from ..harness.leader_sim import World as SimWorld

    w = SimWorld(policy=PlanPolicy(lost_node="shrink"), can_host=True)
    w.membership = Membership(1, 4, "h", 1, (
        Assignment(0, "n0/w0", "n0", "survivor"), Assignment(1, "n0/w1", "n0", "survivor"),
        Assignment(2, "n0/w1", "n0", "hosted"), Assignment(3, "n0/w0", "n0", "hosted")))
    w.nodes = {"n0"}
    if kill_host:
        w.kill(1)
        w.exits[1] = replace(w.exits[1], local_image=NodeLocalImage(1, "n0", w.committed, 3, 0),
                             local_replicas=(NodeLocalCopy(2, 1, "n0", w.committed, 3, 0),))
    w.report(0)
    return w


def test_a_hosted_rank_never_takes_its_hosts_own_image_as_its_own() -> None:
    """Finding 1's clue: ``node-local image reported for rank 1 on <A>, but the rank ran on <A>``. A hosted
    rank has no process: the exit record the leader found for it was its host's."""
    from ckptless.recovery.gather import plan_from_view

    w = _shrunk_world()
    _, notes = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None, w.policy)
    assert not [n for n in notes if "node-local" in n], notes


def test_a_host_killed_while_shrunk_restarts_on_its_node_and_its_hosted_rank_is_adopted_there() -> None:
    from ckptless.recovery.decision import Adoption, LocalRestore
    from ckptless.recovery.gather import plan_from_view

    w = _shrunk_world()
    d, notes = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None, w.policy)
    assert isinstance(d, RecoveryPlan), (d, notes)  # was: unrecoverable, ranks without a usable image: [2]
    respawn = "n0/respawn-g2-r1"
    assert d.resume_version == w.committed and d.transfers == ()
    assert [(a.rank, a.worker_id, a.source) for a in d.assignments] == [
        (0, "n0/w0", "survivor"), (1, respawn, "respawn"), (2, respawn, "hosted"), (3, "n0/w0", "hosted")]
    assert d.node_local == (LocalRestore(1, respawn, "n0", w.committed, 3, 0),)
    # the respawn re-attaches its predecessor's replica files; the adoption names the copy it hosts from
    assert d.adoptions == (Adoption(respawn, 2, 1, "n0", w.committed, 3, 0),)
    m = Membership(d.generation, 4, "h", 1, d.assignments, d)
    back = membership_from_json(membership_to_json(m))
    assert back.decision == d and back.physical(respawn) == (1, 2) and back.hosted_by(respawn) == [2]


def test_a_host_killed_while_shrunk_without_its_own_copy_is_hosted_too() -> None:
    """No node-local image of the host's own (no --shm-dir on that node, or it did not check): the survivor
    hosts every lost rank, taking the copy of rank 1's and rank 2's images its node kept."""
    from ckptless.recovery.decision import Adoption
    from ckptless.recovery.facts import NodeLocalCopy
    from ckptless.recovery.gather import plan_from_view

    w = _shrunk_world()
    w.exits[1] = replace(w.exits[1], local_image=None,
                         local_replicas=(NodeLocalCopy(2, 1, "n0", w.committed, 3, 0),))
    d, notes = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None, w.policy)
    # rank 1's image is nowhere (its holder was rank 3, on the lost node): one error naming it
    assert isinstance(d, Unrecoverable) and d.lost_ranks_without_replica == (1,), (d, notes)
    w.exits[1] = replace(w.exits[1], local_replicas=(NodeLocalCopy(1, 1, "n0", w.committed, 3, 0),
                                                     NodeLocalCopy(2, 1, "n0", w.committed, 3, 0)))
    d, notes = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None, w.policy)
    assert isinstance(d, RecoveryPlan) and d.hosted == {1: "n0/w0", 2: "n0/w0", 3: "n0/w0"}, (d, notes)
    assert [(a.owner, a.holder) for a in d.adoptions] == [(1, 1), (2, 1)]
    assert all(isinstance(a, Adoption) and a.worker_id == "n0/w0" for a in d.adoptions)



def test_goes_on_at_the_newest_version_every_survivor_holds_itself() -> None:
    """The newest common version (6) would need a transfer to rank 1, which has not captured it: R10 goes on
    at 5, which every survivor holds in its own memory, instead of waiting for a replacement."""
    from ckptless.recovery import PlanningFacts, RankSlot, ReplicaFact, Worker, WorkerReport

    holders = {0: (1, 2), 1: (2, 0), 2: (0, 1)}
    members = tuple(RankSlot(r, Worker(f"{n}/w{r}", n), r != 2) for r, n in enumerate("abc"))

    def rep(r: int, local: set[int]) -> WorkerReport:
        held = tuple(ReplicaFact(o, v, 4) for o in sorted(holders) if r in holders[o] for v in (5, 6))
        return WorkerReport(f"{'abc'[r]}/w{r}", max(local), 5, frozenset(local), held, can_host=True)

    f = PlanningFacts("j", 3, 3, members, (rep(0, {5, 6}), rep(1, {5})), (), holders, None, frozenset({"c"}),
                      PlanPolicy(lost_node="shrink"))
    d = plan_recovery(f)
    assert isinstance(d, RecoveryPlan), d  # was: waiting, "survivors [1] do not hold version 6"
    assert d.resume_version == 5 and d.hosted == {2: "a/w0"} and d.transfers == ()
    assert [(b.rank, b.from_version, b.to_version) for b in d.rollbacks] == [(0, 6, 5)]


def test_a_rank_held_by_two_survivors_goes_to_the_one_the_other_lost_rank_leaves_idle() -> None:
    """Hypothesis's W=13 counterexample, made small: ranks 0 and 3 lost with their nodes; rank 0's image
    is held by ranks 1 and 2, rank 3's by rank 1 only. Rank by rank, the least-loaded holder of rank 0
    was rank 1 (a tie, lower rank), and then rank 3 could only go to rank 1 too: one survivor hosting
    two ranks (three micro-batches a step, the pace of the job) while rank 2 hosted none."""
    from ckptless.recovery import PlanningFacts, RankSlot, ReplicaFact, Worker, WorkerReport

    holders = {0: (1, 2), 1: (2,), 2: (1,), 3: (1,)}
    members = tuple(RankSlot(r, Worker(f"{n}/w{r}", n), r in (1, 2)) for r, n in enumerate("abcd"))

    def rep(r: int) -> WorkerReport:
        held = tuple(ReplicaFact(o, 5, 4) for o in sorted(holders) if r in holders[o])
        return WorkerReport(f"{'abcd'[r]}/w{r}", 5, 5, frozenset({5}), held, can_host=True)

    f = PlanningFacts("j", 3, 4, members, (rep(1), rep(2)), (), holders, None, frozenset({"a", "d"}),
                      PlanPolicy(lost_node="shrink"))
    d = plan_recovery(f)
    assert isinstance(d, RecoveryPlan), d
    assert d.hosted == {0: "c/w2", 3: "b/w1"}  # was: {0: "b/w1", 3: "b/w1"}
