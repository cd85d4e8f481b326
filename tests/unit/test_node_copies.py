"""R11 (issue 35): copies a dead worker left in the node-local tier of a live node, adopted by a live
worker there (pure: the planner over random worlds, the facts the leader gathers from exit records,
and their wire forms).

Over the planner's random worlds (tests/harness/plan_worlds.py) plus random node copies: the plan
resumes at the newest version every rank can get counting the copies (a naive oracle), never at an
older one than without them, and every adoption names a worker of the new generation on the copy's
node that holds the resume version, for an image no live process holds. The worked examples are
issue 35's findings 1 and 5 as the leader sees them (tests/harness/leader_sim.py): they ended
``unrecoverable`` before.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckptless.errors import ConfigError
from ckptless.recovery import PlanningFacts, PlanPolicy, RecoveryPlan, Unrecoverable, WaitForReplacement, Worker
from ckptless.recovery.decision import Adoption, Assignment, DiskFallback, LocalRestore
from ckptless.recovery.facts import NodeLocalCopy, NodeLocalImage
from ckptless.recovery.gather import build_facts, plan_from_view
from ckptless.recovery.plan import plan_recovery
from ckptless.recovery.view import ExitRecord
from ckptless.recovery.wire import Membership, decision_from_doc, decision_to_doc
from ckptless.state.replication import ReplicaSet

from ..harness.leader_sim import World as SimWorld
from ..harness.plan_worlds import SETTINGS, oracle_avail, worlds


# --- random worlds --------------------------------------------------------------------------------------
@st.composite
def worlds_with_copies(draw: st.DrawFn) -> PlanningFacts:
    """Random worlds whose lost ranks on live nodes left copies: their own image and the replicas they
    held (by placement), at versions around the committed one; sometimes with a suffix only."""
    w = draw(worlds())
    f = w.facts
    if draw(st.booleans()):
        f = replace(f, dead_nodes=frozenset())  # processes killed, nodes alive
    rnd = random.Random(draw(st.integers(0, 2**32)))
    c = w.committed
    copies: dict[tuple[str, int, int, int], NodeLocalCopy] = {}
    for r in f.lost_ranks:
        node = f.slot(r).worker.node_id
        if node in f.dead_nodes or rnd.random() < 0.2:
            continue
        owners = [r] + [o for o, hs in f.placement.items() if r in hs]
        for o in owners:
            for v in rnd.sample([max(0, c - 1), c, c + 1], rnd.randint(0, 2)):
                peers = None
                first = 0
                if o != r and rnd.random() < 0.2 and f.world_size > 2:
                    peers, first = ReplicaSet.of_ranks(range(f.world_size)), 1
                n = rnd.randint(first, 40)
                cp = NodeLocalCopy(o, r, node, v, n, rnd.randint(0, 2), "", first if n >= first else 0,
                                   peers if n >= first else None)
                copies.setdefault(cp.key, cp)
    # holders disagree on nothing: one size per (owner, version), as the reports' sanitiser ensures
    sizes: dict[tuple[int, int], int] = {}
    for rep in f.reports:
        for x in rep.replicas:
            sizes.setdefault((x.owner, x.version), x.n_chunks)
    out = []
    for cp in copies.values():
        n = sizes.setdefault((cp.owner, cp.version), cp.n_chunks)
        out.append(replace(cp, n_chunks=max(n, cp.first_chunk)))
    return replace(f, node_copies=tuple(out))


def _oracle(f: PlanningFacts) -> dict[int, set[int]]:
    """Versions each rank can get: the planner's naive oracle, plus a copy's version when a survivor on
    its live node (not the owner itself) holds that version of its own state; capped as the planner caps."""
    uncapped = replace(f, policy=replace(f.policy, resume_beyond_committed=True))
    avail = oracle_avail(uncapped)
    alive = {s.worker.worker_id: s for s in f.members if s.alive}
    for cp in f.node_copies:
        if cp.node_id in f.dead_nodes or cp.peers is not None:
            continue  # (a suffix-only copy also needs a live replica of the prefix: not modelled here)
        if any(s.worker.node_id == cp.node_id and s.rank != cp.owner and cp.version in rep.local_versions
               for rep in f.reports for s in (alive[rep.worker_id],)):
            avail[cp.owner].add(cp.version)
    if not f.policy.resume_beyond_committed:
        cap = max((r.committed for r in f.reports if r.committed is not None), default=-1)
        avail = {r: {v for v in vs if v <= cap} for r, vs in avail.items()}
    return avail


MORE = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@MORE
@given(worlds_with_copies())
def test_r11_plan_matches_oracle_and_adopts_only_what_no_live_process_holds(f: PlanningFacts) -> None:
    d = plan_recovery(f)
    d0 = plan_recovery(replace(f, node_copies=()))
    event(f"{type(d0).__name__} -> {type(d).__name__}")
    if isinstance(d0, RecoveryPlan):
        assert isinstance(d, RecoveryPlan) and d.resume_version >= d0.resume_version, "copies never make it worse"
        assert d.assignments == d0.assignments
    if isinstance(d, (WaitForReplacement, Unrecoverable)) or isinstance(d0, WaitForReplacement):
        assert type(d) is type(d0) or isinstance(d0, Unrecoverable)
        return
    common = set.intersection(*_oracle(f).values())
    if isinstance(d, DiskFallback):
        assert not common
        return
    assert isinstance(d, RecoveryPlan)
    assert d.resume_version >= max(common, default=-1), "at least the newest version the oracle finds"
    alive = {s.worker.worker_id: s for s in f.members if s.alive}
    held_live = {(x.owner, x.version) for rep in f.reports for x in rep.replicas}
    by_key = {(cp.node_id, cp.holder, cp.owner, cp.version): cp for cp in f.node_copies}
    adopted = {a.owner: a for a in d.adoptions}
    assert len(adopted) == len(d.adoptions), "one adoption per image"
    event(f"adoptions: {min(len(d.adoptions), 3)}")
    for a in d.adoptions:
        cp = by_key[(a.node_id, a.holder, a.owner, a.version)]
        assert (a.n_chunks, a.generation, a.version) == (cp.n_chunks, cp.generation, d.resume_version)
        s = alive[a.worker_id]
        assert s.worker.node_id == a.node_id and s.rank != a.owner
        assert d.resume_version in f.report_of(a.worker_id).local_versions  # type: ignore[union-attr]
        assert (a.owner, a.version) not in held_live, "only for an image no live process holds"
    for t in d.transfers:
        if t.owner in adopted:
            assert t.holders == (adopted[t.owner].worker_id,)
            assert all(s.source == adopted[t.owner].worker_id for s in t.stripes if not s.own)
    assert {t.owner for t in d.transfers} >= set(adopted)


@SETTINGS
@given(worlds_with_copies(), st.integers(0, 2**32))
def test_r11_deterministic_and_order_independent(f: PlanningFacts, seed: int) -> None:
    copies = list(f.node_copies)
    random.Random(seed).shuffle(copies)
    assert plan_recovery(f) == plan_recovery(replace(f, node_copies=tuple(copies)))


@MORE
@given(worlds_with_copies())
def test_r11_with_fewer_ranks_every_host_holds_or_adopts_what_it_hosts(f: PlanningFacts) -> None:
    f = replace(f, reports=tuple(replace(r, can_host=True) for r in f.reports),
                policy=replace(f.policy, lost_node="shrink"))
    d = plan_recovery(f)
    d0 = plan_recovery(replace(f, node_copies=()))
    event(f"{type(d0).__name__} -> {type(d).__name__}")
    if isinstance(d0, RecoveryPlan):
        assert isinstance(d, RecoveryPlan) and d.resume_version >= d0.resume_version
    if not (isinstance(d, RecoveryPlan) and d.hosted):
        return
    assert d.transfers == (), "nothing moves between the processes of a generation with fewer ranks"
    event(f"hosted from a node copy: {min(len(d.adoptions), 2)}")
    alive = {s.worker.worker_id: s for s in f.members if s.alive}
    adopted = {(a.worker_id, a.owner): a for a in d.adoptions}
    for rank, host in d.hosted.items():
        rep = f.report_of(host)
        assert rep is not None and d.resume_version in rep.local_versions
        in_memory = any(x.owner == rank and x.version == d.resume_version for x in rep.replicas)
        a = adopted.get((host, rank))
        assert in_memory != (a is not None), "held in memory, or adopted from its node's copy (never both)"
        if a is not None:
            assert a.node_id == alive[host].worker.node_id and a.version == d.resume_version
            assert not any(x.owner == rank and x.version == d.resume_version for r in f.reports for x in r.replicas)


def test_node_copy_facts_are_checked() -> None:
    with pytest.raises(ConfigError):
        NodeLocalCopy(1, 1, "", 3, 4)
    with pytest.raises(ConfigError):
        NodeLocalCopy(1, 2, "a", 3, 4, first_chunk=2)  # a suffix-only copy names its replicas
    base = build_facts(SimWorld().view(), "job", frozenset(), 1, "ring", None)[0]
    cp = NodeLocalCopy(1, 1, "n0", 3, 4)
    with pytest.raises(ConfigError, match="listed twice"):
        replace(base, node_copies=(cp, cp))
    with pytest.raises(ConfigError):
        replace(base, node_copies=(replace(cp, owner=9),))


# --- records ------------------------------------------------------------------------------------------
def test_exit_record_carries_the_replicas_and_stays_backward_compatible() -> None:
    copies = (NodeLocalCopy(2, 1, "a", 7, 5, 1, "key"),
              NodeLocalCopy(3, 1, "a", 7, 9, 1, "", 2, ReplicaSet.of_ranks(range(4))))
    rec = ExitRecord(1, "a/w1", "a", 42, None, 9, 1.5, local_image=NodeLocalImage(1, "a", 7, 3, 1),
                     local_replicas=copies)
    assert ExitRecord.from_json(rec.to_json()) == rec
    doc = json.loads(rec.to_json())
    doc["local_replicas"].append(["x", 1])  # a malformed entry is dropped alone
    doc["local_replicas"].append([1, 7, 5, 1, "", 0])  # its own rank: that is local_image's job
    assert ExitRecord.from_json(json.dumps(doc).encode()) == rec
    del doc["local_replicas"]  # an older agent's record
    assert ExitRecord.from_json(json.dumps(doc).encode()) == replace(rec, local_replicas=())


def test_plan_with_adoptions_round_trips_and_old_plans_decode() -> None:
    d = _finding5_overlap()[0]
    assert isinstance(d, RecoveryPlan) and d.adoptions
    doc = json.loads(json.dumps(decision_to_doc(d)))
    assert decision_from_doc(doc) == d
    del doc["adoptions"]
    assert decision_from_doc(doc) == replace(d, adoptions=())


# --- issue 35, finding 5: two overlapping losses, the copy on a live node ----------------------------------
def _finding5_overlap(published: bool = False) -> tuple[object, list[str]]:
    """2 nodes x 2 (K = 1 ring: 0<-2, 1<-3, 2<-1, 3<-0) and a spare node: rank 3 is SIGKILLed, then node
    n0 (ranks 0, 1, the leader) is lost. Rank 1's only replica was in rank 3's process, rank 3's own
    image in its own: both are in node n1's memory, where rank 2 lives. ``published``: the plan that
    gave rank 3 a spare was out (that spare has not restored) when node n0 went."""
    w = SimWorld()
    w.nodes |= {"n2"}
    w.spares = [Worker(f"n2/spare{i}", "n2") for i in range(3 if published else 2)]
    w.kill(3)
    a3 = w.membership.worker_of(3)
    w.exits[3] = replace(w.exits[3], local_image=NodeLocalImage(3, a3.node_id, w.committed, 3, 0),
                         local_replicas=(NodeLocalCopy(1, 3, a3.node_id, w.committed, 3, 0),))
    lost = frozenset({3})
    if published:
        d1, _ = plan_from_view(w.view(), "job", lost, 1, "ring", None)
        assert isinstance(d1, RecoveryPlan) and d1.rank_to_worker[3] == "n2/spare0"
        w.publish(d1)
        lost = frozenset()
    w.lose_node("n0")
    w.report(2)
    if published:
        w.report(3, fresh=True)
    return plan_from_view(w.view(), "job", lost, 1, "ring", None)


def test_finding5_a_rank_and_then_its_holders_node_are_lost_the_copies_on_its_node_are_used() -> None:
    d, notes = _finding5_overlap()
    assert isinstance(d, RecoveryPlan), (d, notes)  # was: unrecoverable, ranks without a usable image: [1]
    assert d.resume_version == 4 and d.rank_to_worker[3] == "n1/respawn-g1-r3"
    assert d.node_local == (LocalRestore(3, "n1/respawn-g1-r3", "n1", 4, 3, 0),)
    assert d.adoptions == (Adoption("n1/w0", 1, 3, "n1", 4, 3, 0),)
    assert {t.owner: t.holders for t in d.transfers} == {0: ("n1/w0",), 1: ("n1/w0",)}


def test_finding5_the_same_after_the_first_plan_was_out() -> None:
    """Rank 3's spare holds nothing yet; its own image is on node n1 (its predecessor's), and so is rank 1's."""
    d, notes = _finding5_overlap(published=True)
    assert isinstance(d, RecoveryPlan), (d, notes)  # was: unrecoverable, ... [1, 3]
    assert d.resume_version == 4 and d.rank_to_worker[3] == "n2/spare0"
    assert d.adoptions == (Adoption("n1/w0", 1, 3, "n1", 4, 3, 0), Adoption("n1/w0", 3, 3, "n1", 4, 3, 0))
    assert {t.owner: t.holders for t in d.transfers} == {0: ("n1/w0",), 1: ("n1/w0",), 3: ("n1/w0",)}


def test_a_copy_on_a_node_where_a_later_process_of_its_rank_runs_is_not_trusted() -> None:
    """That process re-attached its predecessor's replicas and may have rewritten them; a record of a
    rank that runs on another node now is good (no process of that rank touched those files since)."""
    w = SimWorld()
    cp3 = NodeLocalCopy(1, 3, "n1", w.committed, 3, 0)
    w.exits[3] = ExitRecord(3, "n1/older", "n1", 1, None, 9, 0.0, local_replicas=(cp3,))  # rank 3 runs on n1
    cp1 = NodeLocalCopy(0, 1, "n1", w.committed, 3, 0)
    w.exits[1] = ExitRecord(1, "n1/older-r1", "n1", 1, None, 9, 0.0, local_replicas=(cp1,))  # rank 1 on n0
    facts, _ = build_facts(w.view(), "job", frozenset(), 1, "ring", None)
    assert facts.node_copies == (cp1,)


def test_a_record_from_another_node_is_trusted_and_a_dead_nodes_is_not() -> None:
    w = SimWorld()
    w.exits[1] = ExitRecord(1, "n1/older-r1", "n1", 1, None, 9, 0.0,
                            local_replicas=(NodeLocalCopy(0, 1, "n1", w.committed, 3, 0),))
    facts, _ = build_facts(w.view(), "job", frozenset(), 1, "ring", None)
    assert facts.node_copies == (NodeLocalCopy(0, 1, "n1", w.committed, 3, 0),)
    w.lose_node("n1")
    w.report(0), w.report(1)
    facts, _ = build_facts(w.view(), "job", frozenset(), 1, "ring", None)
    assert facts.node_copies == ()


def test_membership_with_a_respawn_that_hosts_names_it_a_process() -> None:
    m = Membership(2, 4, "h", 1, (Assignment(0, "a/w0", "a", "survivor"), Assignment(1, "a/respawn-g2-r1", "a", "respawn"),
                                  Assignment(2, "a/respawn-g2-r1", "a", "hosted"), Assignment(3, "a/w0", "a", "hosted")))
    assert m.physical("a/respawn-g2-r1") == (1, 2) and m.hosted_by("a/respawn-g2-r1") == [2]
    assert m.rank_of("a/respawn-g2-r1") == 1


def test_a_copy_a_worker_failed_to_adopt_is_never_planned_again() -> None:
    """Gone, or corrupt since its agent checked it: the adopter's report names it (re-planning with it would
    fail the same way, generation after generation)."""
    from ckptless.errors import NodeCopyError
    from ckptless.recovery.view import ReportRecord, report_record_from_json, report_record_to_json
    from ckptless.worker.runtime import ReportNotes

    d, _ = _finding5_overlap()
    assert isinstance(d, RecoveryPlan) and d.adoptions
    key = ("n1", 3, 1, 4)
    notes = ReportNotes().failed(NodeCopyError(key, "gone"))
    assert notes.recheck and notes.bad_copies == (key,) and notes.failed(NodeCopyError(key, "x")).bad_copies == (key,)
    w = SimWorld()
    w.nodes |= {"n2"}
    w.spares = [Worker(f"n2/spare{i}", "n2") for i in range(2)]
    w.kill(3)
    w.exits[3] = replace(w.exits[3], local_image=NodeLocalImage(3, "n1", w.committed, 3, 0),
                         local_replicas=(NodeLocalCopy(1, 3, "n1", w.committed, 3, 0),))
    w.lose_node("n0")
    w.report(2)
    rec = w.reports[2]
    w.reports[2] = report_record_from_json(report_record_to_json(rec.report, "restore failed", None, (key,)))
    assert w.reports[2] == ReportRecord(rec.report, "restore failed", None, (key,))
    d2, _ = plan_from_view(w.view(), "job", frozenset({3}), 1, "ring", None)
    assert isinstance(d2, Unrecoverable) and d2.lost_ranks_without_replica == (1,), d2  # the one copy of rank 1
    d3, _ = plan_from_view(w.view(), "job", frozenset({3}), 1, "ring", 2)
    assert isinstance(d3, DiskFallback)


def test_a_later_process_of_the_rank_that_never_resumed_changed_none_of_its_files() -> None:
    """A respawn whose restore failed (or that has not run yet): its predecessor's copies on its node are good."""
    w = SimWorld()
    cp = NodeLocalCopy(1, 3, "n1", w.committed, 3, 0)
    w.exits[3] = ExitRecord(3, "n1/w1", "n1", 1, None, 9, 0.0, local_replicas=(cp,))
    d = RecoveryPlan("job", 1, tuple(Assignment(a.rank, "n1/respawn-g1-r3" if a.rank == 3 else a.worker_id,
                                                a.node_id, "respawn" if a.rank == 3 else "survivor")
                                     for a in w.membership.ranks), (3,), w.committed, (), (), True, (), 0)
    w.publish(d)
    facts, _ = build_facts(w.view(), "job", frozenset(), 1, "ring", None)
    assert facts.node_copies == (cp,), "not resumed: fresh"
    w.ready = {3}
    facts, _ = build_facts(w.view(), "job", frozenset(), 1, "ring", None)
    assert facts.node_copies == (), "resumed: its mirror rounds own those files now"


def test_a_record_from_another_node_does_not_hide_the_copies_an_older_one_names() -> None:
    """Finding 5 after the first plan was out: rank 3's spare died on the spare node (a newer record of rank 3);
    rank 3's first worker's files on node n1 are untouched, and its record there still counts."""
    w = SimWorld()
    cp = NodeLocalCopy(1, 3, "n1", w.committed, 3, 0)
    w.exits[3] = ExitRecord(3, "n1/w1", "n1", 1, None, 9, 1.0, local_replicas=(cp,))
    view = w.view()
    newer = ExitRecord(3, "s/spare0", "s", 2, 1, None, 2.0, kind="fault")
    view = replace(view, exits={**view.exits, 3: newer}, worker_exits={**view.worker_exits, "s/spare0": newer})
    facts, _ = build_facts(view, "job", frozenset(), 1, "ring", None)
    assert facts.node_copies == (cp,)


def test_a_rank_killed_before_it_learned_the_newest_commit_leaves_an_older_image_one_error_names_it() -> None:
    """Its node kept its own image of v3 only (the manifest is written at the commit its engine had not seen
    yet), the survivors hold v4 and newer: no version is complete anywhere, so one error names rank 3."""
    w = SimWorld()
    w.nodes |= {"n2"}
    w.spares = [Worker(f"n2/spare{i}", "n2") for i in range(2)]
    w.kill(3)
    w.exits[3] = replace(w.exits[3], local_image=NodeLocalImage(3, "n1", w.committed - 1, 3, 0),
                         local_replicas=(NodeLocalCopy(1, 3, "n1", w.committed, 3, 0),))
    w.lose_node("n0")
    w.report(2)
    d, _ = plan_from_view(w.view(), "job", frozenset({3}), 1, "ring", None)
    assert isinstance(d, Unrecoverable) and d.lost_ranks_without_replica == (3,), d
    assert "of a live node" in d.reason
