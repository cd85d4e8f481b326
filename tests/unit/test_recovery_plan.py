"""Properties of the pure recovery planner over random worlds.

Each world: W ranks on nodes, a ring placement with K mirrors, a committed
version C, per-rank local images, per-holder replicas (honest or arbitrary),
a random failure set (ranks and whole nodes), spares and maybe a snapshot.
The test recomputes the key quantities with a deliberately naive oracle and
checks the planner against it.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ckptless.errors import ConfigError, UnrecoverableError
from ckptless.recovery import (
    DiskFallback,
    PlanningFacts,
    PlanPolicy,
    RankSlot,
    RecoveryPlan,
    ReplicaFact,
    Unrecoverable,
    WaitForReplacement,
    Worker,
    WorkerReport,
    plan_recovery,
    stripe_image,
)

from ..harness.plan_worlds import SETTINGS, World, example_facts, oracle_avail, ring, worlds


def check_assignments(f: PlanningFacts, plan: RecoveryPlan | DiskFallback) -> None:
    ranks = [a.rank for a in plan.assignments]
    assert ranks == list(range(f.world_size)), "every rank exactly once, sorted"
    ids = [a.worker_id for a in plan.assignments]
    assert len(set(ids)) == len(ids), "no worker twice"
    spare_ids = {w.worker_id: w for w in f.spares}
    for a in plan.assignments:
        slot = f.slot(a.rank)
        if slot.alive:
            assert a.source == "survivor" and a.worker_id == slot.worker.worker_id
        elif a.source == "spare":
            assert a.worker_id in spare_ids and spare_ids[a.worker_id].node_id not in f.dead_nodes
        else:
            assert a.source == "respawn" and a.node_id == slot.worker.node_id
            assert a.node_id not in f.dead_nodes
            assert a.rank not in f.no_respawn, "never respawned onto the node whose GPU for it failed"
    assert plan.generation == f.generation + 1


def check_stripes(n: int, holders: tuple[str, ...], stripes: tuple) -> None:
    covered = [c for s in stripes for c in range(s.start, s.stop)]
    assert covered == list(range(n)), "every chunk exactly once, in order"
    assert all(s.source in holders for s in stripes)
    assert len({s.source for s in stripes}) == len(stripes)
    if stripes:
        sizes = [s.n_chunks for s in stripes] + [0] * (len(holders) - len(stripes))
        assert max(sizes) - min(sizes) <= 1, "balanced within one chunk"
    for s in stripes:
        assert s.source not in s.fallbacks and set(s.fallbacks) | {s.source} == set(holders)


@SETTINGS
@given(worlds())
def test_plan_matches_oracle(world: World) -> None:
    f = world.facts
    d = plan_recovery(f)
    event(type(d).__name__)
    avail = oracle_avail(f)
    common = set.intersection(*avail.values())
    # ranks with no respawn option: their node is gone, or their GPU failed and none is left there
    dead_node_lost = [r for r in f.lost_ranks if f.slot(r).worker.node_id in f.dead_nodes or r in f.no_respawn]
    live_spares = [s for s in f.spares if s.node_id not in f.dead_nodes]
    needs_wait = len(dead_node_lost) > len(live_spares)
    if not common and f.snapshot_step is None:
        assert isinstance(d, Unrecoverable)
        with pytest.raises(UnrecoverableError):
            d.raise_error()
        return
    if needs_wait:
        assert isinstance(d, WaitForReplacement) and d.generation == f.generation
        assert d.then == ("memory" if common else "disk")
        assert set(d.unassigned_ranks) <= set(dead_node_lost)
        return
    if not common:
        # DiskFallback iff no version is available for every rank (state of R3/R4).
        assert isinstance(d, DiskFallback)
        check_assignments(f, d)
        assert d.snapshot_step == f.snapshot_step and d.steps_lost >= 0
        assert d.lost_ranks_without_replica
        return
    assert isinstance(d, RecoveryPlan)
    check_assignments(f, d)
    r = d.resume_version
    assert r == max(common), "newest version complete everywhere"
    assert all(r in vs for vs in avail.values()), "never resume from a version some rank lacks"
    survivors = [rep for rep in f.reports]
    if world.honest:
        assert r >= min(rep.committed for rep in survivors if rep.committed is not None)
    alive_rank = {s.worker.worker_id: s.rank for s in f.members if s.alive}
    local = {alive_rank[rep.worker_id]: rep for rep in f.reports}
    expected_transfers = sorted(x for x in range(f.world_size)
                                if x not in local or r not in local[x].local_versions)
    assert [t.owner for t in d.transfers] == expected_transfers
    for t in d.transfers:
        holders_with_r = {rep.worker_id for rep in f.reports
                          if any(rf.owner == t.owner and rf.version == r for rf in rep.replicas)}
        assert set(t.holders) == holders_with_r and t.version == r
        assert t.receiver == d.rank_to_worker[t.owner]
        check_stripes(t.n_chunks, t.holders, t.stripes)
    expected_rb = sorted(x for x, rep in local.items()
                         if r in rep.local_versions and (rep.newest_captured or 0) > r)
    assert [b.rank for b in d.rollbacks] == expected_rb
    assert all(b.to_version == r < b.from_version for b in d.rollbacks)
    assert d.replace_mirrors == bool(f.lost_ranks or d.owners_below_k or d.transfers)


@SETTINGS
@given(worlds(honest=True))
def test_honest_world_within_k_recovers_from_memory(world: World) -> None:
    """Commit invariant holds and every lost owner keeps >= 1 live holder:
    memory recovery, resuming at committed-or-newer."""
    f = world.facts
    lost = set(f.lost_ranks)
    covered = all(any(h not in lost for h in f.placement[r]) for r in lost)
    d = plan_recovery(f)
    newest_commit = max(rep.committed or 0 for rep in f.reports)
    if covered and not isinstance(d, WaitForReplacement):
        if f.policy.resume_beyond_committed or newest_commit == world.committed:
            assert isinstance(d, RecoveryPlan)
            assert d.resume_version >= world.committed
        if isinstance(d, RecoveryPlan) and not f.policy.resume_beyond_committed:
            assert d.resume_version == newest_commit
    if not covered and f.snapshot_step is None:
        assert isinstance(d, Unrecoverable)


@SETTINGS
@given(worlds(), st.integers(0, 2**32))
def test_deterministic_and_order_independent(world: World, seed: int) -> None:
    f = world.facts
    rnd = random.Random(seed)

    def shuffled(xs: tuple) -> tuple:
        out = list(xs)
        rnd.shuffle(out)
        return tuple(out)

    reports = shuffled(tuple(replace(rep, replicas=shuffled(rep.replicas)) for rep in f.reports))
    g = replace(f, members=shuffled(f.members), reports=reports, spares=shuffled(f.spares),
                placement=dict(reversed(list(f.placement.items()))))
    assert plan_recovery(f) == plan_recovery(f) == plan_recovery(g)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.lists(st.text("abc", min_size=1, max_size=3), min_size=1,
                                     max_size=8, unique=True), st.integers(0, 64))
def test_stripe_image_covers_and_balances(n: int, holders: list[str], owner: int) -> None:
    stripes = stripe_image(owner, n, tuple(holders))
    check_stripes(n, tuple(holders), stripes)
    assert len(stripes) == min(n, len(holders))


# --- worked examples (the ones in docs/recovery.md; the facts: harness/plan_worlds.py) ---------------
def test_example_memory_plan() -> None:
    d = plan_recovery(example_facts(spares=(Worker("b/spare", "b"), Worker("c/spare", "c"))))
    assert isinstance(d, RecoveryPlan)
    assert d.generation == 8 and d.resume_version == 100 and d.resume_step == 101
    # rank 1's only holder (rank 2) lives on node b: the spare on c is preferred
    assert d.rank_to_worker == {0: "a/w0", 1: "c/spare", 2: "b/w2", 3: "b/w3"}
    assert [(b.rank, b.from_version) for b in d.rollbacks] == [(0, 101), (3, 101)]
    (t,) = d.transfers
    assert (t.owner, t.version, t.holders, t.receiver) == (1, 100, ("b/w2",), "c/spare")
    assert [(s.start, s.stop, s.source) for s in t.stripes] == [(0, 10, "b/w2")]
    assert d.steps_lost == 1 and d.replace_mirrors and d.owners_below_k == (0, 1)


def test_spare_standing_by_for_the_lost_rank_is_preferred() -> None:
    """A spare that already built rank 1's objects beats the better-placed one that did not."""
    spares = (Worker("b/spare", "b", standby_rank=1), Worker("c/spare", "c", standby_rank=0))
    d = plan_recovery(example_facts(spares=spares))
    assert isinstance(d, RecoveryPlan) and d.rank_to_worker[1] == "b/spare"
    d2 = plan_recovery(example_facts(spares=(Worker("b/spare", "b", standby_rank=3), Worker("c/spare", "c"))))
    assert isinstance(d2, RecoveryPlan) and d2.rank_to_worker[1] == "c/spare", "no match: placement decides"


def test_initial_restart_before_the_first_commit() -> None:
    """R0: nothing committed or mirrored: survivors restore their initial capture, the lost rank
    starts from the state its fresh process builds; nothing is transferred."""
    node = {0: "a", 1: "a", 2: "b", 3: "b"}
    members = tuple(RankSlot(r, Worker(f"{node[r]}/w{r}", node[r]), r != 1) for r in range(4))
    reps = tuple(WorkerReport(f"{node[r]}/w{r}", v, None, frozenset({0, v} - {None}))  # type: ignore[operator]
                 for r, v in ((0, 1), (2, 0), (3, 0)))
    d = plan_recovery(PlanningFacts("demo", 0, 4, members, reps, (), ring(4, 1), None))
    assert isinstance(d, RecoveryPlan) and d.resume_version == 0 and d.initial_ranks == (1,)
    assert not d.transfers and [(b.rank, b.from_version, b.to_version) for b in d.rollbacks] == [(0, 1, 0)]
    # a survivor that no longer holds the initial capture: no consistent restart point
    gone = tuple(replace(r, local_versions=frozenset({1}), newest_captured=1) if r.worker_id == "b/w2" else r
                 for r in reps)
    assert isinstance(plan_recovery(PlanningFacts("demo", 0, 4, members, gone, (), ring(4, 1), None)),
                      Unrecoverable)


def test_example_respawn_and_wait() -> None:
    d = plan_recovery(example_facts(prefer="respawn", spares=(Worker("c/spare", "c"),)))
    assert isinstance(d, RecoveryPlan)
    assert d.rank_to_worker[1] == "a/respawn-g8-r1"
    w = plan_recovery(example_facts(spares=()))
    assert isinstance(w, RecoveryPlan)  # no spare, but node a is alive: respawn
    assert w.assignments[1].source == "respawn"
    members = tuple(replace(s, alive=s.rank not in (0, 1)) for s in example_facts().members)
    f = replace(example_facts(), members=members, reports=example_facts().reports[1:], dead_nodes=frozenset({"a"}))
    w2 = plan_recovery(f)
    assert isinstance(w2, WaitForReplacement) and w2.unassigned_ranks == (0, 1) and w2.generation == 7


def test_example_disk_fallback_and_unrecoverable() -> None:
    base = example_facts(spares=(Worker("c/spare", "c"),))
    reports = tuple(replace(r, replicas=()) if r.worker_id == "b/w2" else r for r in base.reports)
    d = plan_recovery(replace(base, reports=reports))
    assert isinstance(d, DiskFallback)
    assert d.snapshot_step == 90 and d.lost_ranks_without_replica == (1,) and d.steps_lost == 11
    u = plan_recovery(replace(base, reports=reports, snapshot_step=None))
    assert isinstance(u, Unrecoverable) and u.lost_ranks_without_replica == (1,)
    with pytest.raises(UnrecoverableError, match="no disk snapshot"):
        u.raise_error()


def test_never_resumes_beyond_commit_when_told() -> None:
    """101 is complete for every rank but nobody has heard it committed yet."""
    base = example_facts(spares=(Worker("c/spare", "c"),))
    reps = tuple(WorkerReport("b/w2", 101, 100, frozenset({100, 101}),
                              (ReplicaFact(1, 100, 10), ReplicaFact(1, 101, 10)))
                 if r.worker_id == "b/w2" else r for r in base.reports)
    eager = plan_recovery(replace(base, reports=reps))
    strict = plan_recovery(replace(base, reports=reps, policy=PlanPolicy(resume_beyond_committed=False)))
    assert isinstance(eager, RecoveryPlan) and eager.resume_version == 101 and not eager.rollbacks
    assert isinstance(strict, RecoveryPlan) and strict.resume_version == 100
    assert len(strict.rollbacks) == 3


@pytest.mark.parametrize("mutate, field", [
    (lambda f: replace(f, world_size=5), "members"),
    (lambda f: replace(f, reports=f.reports[1:]), "reports"),
    (lambda f: replace(f, reports=f.reports + (WorkerReport("zz", None, None),)), "reports"),
    (lambda f: replace(f, spares=(Worker("a/w0", "a"),)), "spares"),
    (lambda f: replace(f, dead_nodes=frozenset({"b"})), "members[2].alive"),
    (lambda f: replace(f, placement={0: (0,)}), "placement[0]"),
    (lambda f: replace(f, snapshot_step=-1), "snapshot_step"),
    (lambda f: replace(f, generation=-1), "generation"),
])
def test_inconsistent_facts_are_rejected(mutate, field) -> None:
    with pytest.raises(ConfigError) as exc:
        mutate(example_facts())
    assert exc.value.field == field


@pytest.mark.parametrize("kwargs, field", [
    (dict(newest_captured=5, committed=4, local_versions=frozenset({5})), "report[x].committed"),
    (dict(newest_captured=6, committed=5, local_versions=frozenset({5})), "report[x].newest_captured"),
    (dict(newest_captured=6, committed=6, local_versions=frozenset({5, 6})), "report[x].local_versions"),
    (dict(newest_captured=None, committed=None,
          replicas=(ReplicaFact(1, 1, 1), ReplicaFact(1, 2, 1), ReplicaFact(1, 3, 1))), "report[x].replicas"),
    (dict(newest_captured=None, committed=None,
          replicas=(ReplicaFact(1, 1, 1), ReplicaFact(1, 1, 1))), "report[x].replicas"),
])
def test_bad_reports_are_rejected(kwargs, field) -> None:
    with pytest.raises(ConfigError) as exc:
        WorkerReport("x", **kwargs)
    assert exc.value.field == field


def test_chunk_count_disagreement_rejected() -> None:
    base = example_facts()
    reps = tuple(replace(r, replicas=(ReplicaFact(1, 100, 9),)) if r.worker_id == "b/w3" else r
                 for r in base.reports)
    with pytest.raises(ConfigError, match="chunks elsewhere"):
        replace(base, reports=reps)


def _layouts(facts: PlanningFacts, keys: dict[int, str]) -> PlanningFacts:
    """The same facts, each replica carrying its owner's layout key from ``keys``."""
    reps = tuple(replace(r, replicas=tuple(replace(f, layout=keys.get(f.owner, "")) for f in r.replicas))
                 for r in facts.reports)
    return replace(facts, reports=reps)


def test_any_rank_spare_takes_a_rank_of_its_standby_layout() -> None:
    """R2: a pre-built --spare-any-rank spare built as rank 3 takes lost rank 1 when their images
    have the same layout key, listed in adopt_prebuilt (no re-exec); never on a differing key."""
    fits = Worker("b/spare", "b", standby_rank=3, any_rank=True)
    plain = Worker("c/spare", "c")
    d = plan_recovery(_layouts(example_facts(spares=(fits, plain)), {1: "L", 2: "M", 3: "L"}))
    assert isinstance(d, RecoveryPlan)
    # it beats the better-placed spare that would have to build (node c holds none of rank 1's mirrors)
    assert d.rank_to_worker[1] == "b/spare" and d.adopt_prebuilt == (1,)
    other = plan_recovery(_layouts(example_facts(spares=(fits, plain)), {1: "L", 2: "M", 3: "X"}))
    assert isinstance(other, RecoveryPlan) and other.rank_to_worker[1] == "c/spare" and other.adopt_prebuilt == ()
    unknown = plan_recovery(_layouts(example_facts(spares=(fits, plain)), {1: "L", 2: "M"}))
    assert isinstance(unknown, RecoveryPlan) and unknown.adopt_prebuilt == (), "rank 3's layout unknown: no adoption"
    undeclared = replace(fits, any_rank=False)
    d2 = plan_recovery(_layouts(example_facts(spares=(undeclared,)), {1: "L", 2: "M", 3: "L"}))
    assert isinstance(d2, RecoveryPlan) and d2.rank_to_worker[1] == "b/spare" and d2.adopt_prebuilt == (), (
        "without --spare-any-rank the spare is assigned but restarts as the rank")


def test_layout_keys_reported_twice_differently_are_unknown() -> None:
    from ckptless.recovery.plan import layout_index, layouts_match

    f = _layouts(example_facts(), {1: "L", 3: "L"})
    assert layouts_match(layout_index(f), 1, 3)
    reps = list(f.reports)
    reps[0] = replace(reps[0], replicas=reps[0].replicas + (ReplicaFact(1, 100, 10, "Z"),))
    assert not layouts_match(layout_index(replace(f, reports=tuple(reps))), 1, 3)


def test_a_standby_ranks_layout_is_known_from_its_own_image() -> None:
    """The standby rank's only holder died with it (found by the refill e2e test): its own report's
    own_layouts still tell the planner its layout."""
    fits = Worker("b/spare", "b", standby_rank=0, any_rank=True)
    f = _layouts(example_facts(spares=(fits,)), {1: "L"})  # nobody holds a replica of rank 0
    assert plan_recovery(f).adopt_prebuilt == ()  # type: ignore[union-attr]
    reps = tuple(replace(r, own_layouts=((100, "L"), (101, "L"))) if r.worker_id == "a/w0" else r for r in f.reports)
    d = plan_recovery(replace(f, reports=reps))
    assert isinstance(d, RecoveryPlan) and d.rank_to_worker[1] == "b/spare" and d.adopt_prebuilt == (1,)


def test_adoption_needs_equal_keys_at_the_resume_version_itself() -> None:
    from ckptless.recovery.decision import Assignment
    from ckptless.recovery.plan import prebuilt_adoptions

    fits = Worker("b/spare", "b", standby_rank=3, any_rank=True)
    f = _layouts(example_facts(spares=(fits,)), {1: "L", 3: "L"})
    a = [Assignment(1, "b/spare", "b", "spare")]
    assert prebuilt_adoptions(f, a, 100) == (1,)
    assert prebuilt_adoptions(f, a, 99) == (), "rank 3's layout at v99 is unknown"
    reps = tuple(replace(r, replicas=tuple(replace(x, layout="Z") if (x.owner, x.version) == (3, 100) else x
                                           for x in r.replicas)) for r in f.reports)
    assert prebuilt_adoptions(replace(f, reports=reps), a, 100) == (), "changed at v100: another layout"
