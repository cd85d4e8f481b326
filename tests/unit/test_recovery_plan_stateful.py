"""A simulated job driven by hypothesis: steps, partial steps, mirror losses,
rank and node kills (also *during* a recovery), spares joining, snapshots.

The simulation keeps the ground truth (which worker holds which version of
which image); facts are derived from it exactly as the coordinator would, and
each decision is checked against that truth, then executed on it. A failure
during recovery is simply another plan from the updated facts: generation
g+1 -> g+2.

With the node-local tier (issue 35), a killed worker leaves its own committed
image and its replicas in its node's memory, which a node loss takes; the
facts name them as its agent would, and the truth counts one when a survivor
on that node holds that version of its own state (it can adopt it, R11).
Invariant: never ``Unrecoverable`` while every rank's image of one version is
in live memory or such a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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
)

from ckptless.recovery.facts import NodeLocalCopy

from ..harness.plan_worlds import ring


def n_chunks(owner: int, version: int) -> int:
    return (owner * 7 + version) % 5 + 1


@dataclass
class W:
    node: str
    alive: bool = True
    local: set[int] = field(default_factory=set)
    committed: int | None = None
    replicas: dict[int, set[int]] = field(default_factory=dict)


class JobSim(RuleBasedStateMachine):
    @initialize(world=st.integers(2, 8), k=st.integers(1, 2), per_node=st.integers(1, 3),
                prefer=st.sampled_from(["spare", "respawn"]), eager=st.booleans(),
                snapshot0=st.booleans(), tier=st.booleans())
    def start(self, world: int, k: int, per_node: int, prefer: str, eager: bool,
              snapshot0: bool, tier: bool) -> None:
        self.world = world
        self.k = min(k, world - 1)
        self.placement = ring(world, self.k)
        self.policy = PlanPolicy(prefer=prefer, resume_beyond_committed=eager)  # type: ignore[arg-type]
        self.workers: dict[str, W] = {}
        self.rank_worker: dict[int, str] = {}
        for r in range(world):
            wid = f"n{r // per_node}/w{r}"
            self.workers[wid] = W(f"n{r // per_node}", local={0}, committed=0,
                                  replicas={o: {0} for o in range(world) if r in self.placement[o]})
            self.rank_worker[r] = wid
        self.spares: dict[str, str] = {}
        self.dead_nodes: set[str] = set()
        self.gpu_failed: set[str] = set()  # workers whose GPU failed with no other free on their node
        self.gen = 0
        self.committed = 0           # ground truth: every image held by itself and its K mirrors
        self.snapshot: int | None = 0 if snapshot0 else None
        self.broken = False          # a step failed part-way: needs a recovery
        self.in_recovery = False     # a plan was adopted but transfers have not finished
        self.ended = False
        self.n_spares = 0
        self.last_resume: int | None = None  # what the coordinator knows: the last plan's resume version
        self.tier = tier  # the node-local tier (--shm-dir) is on
        # (node, holder rank) -> owner -> versions a dead worker of that rank left in the node's memory
        self.files: dict[tuple[str, int], dict[int, set[int]]] = {}

    # --- helpers ----------------------------------------------------------------
    def w(self, rank: int) -> W:
        return self.workers[self.rank_worker[rank]]

    def lost(self) -> list[int]:
        return [r for r in range(self.world) if not self.w(r).alive]

    def healthy(self) -> bool:
        return not (self.ended or self.broken or self.in_recovery or self.lost())

    def facts(self) -> PlanningFacts:
        members = tuple(RankSlot(r, Worker(self.rank_worker[r], self.w(r).node), self.w(r).alive)
                        for r in range(self.world))
        reports = []
        for r in range(self.world):
            w = self.w(r)
            if w.alive:
                reps = tuple(ReplicaFact(o, v, n_chunks(o, v)) for o, vs in sorted(w.replicas.items())
                             for v in sorted(vs))
                reports.append(WorkerReport(self.rank_worker[r], max(w.local, default=None),
                                            w.committed, frozenset(w.local), reps))
        spares = tuple(Worker(wid, node) for wid, node in self.spares.items())
        no_respawn = frozenset(r for r in self.lost() if self.rank_worker[r] in self.gpu_failed)
        copies = tuple(NodeLocalCopy(o, h, node, v, n_chunks(o, v))
                       for (node, h), held in sorted(self.files.items()) if node not in self.dead_nodes
                       for o, vs in sorted(held.items()) for v in sorted(vs))
        return PlanningFacts("sim", self.gen, self.world, members, tuple(reports), spares,
                             self.placement, self.snapshot, frozenset(self.dead_nodes), self.policy,
                             last_resume=self.last_resume, no_respawn=no_respawn, node_copies=copies)

    def leave_files(self, rank: int) -> None:
        """A worker of ``rank`` died with its node alive: its files stay (own committed image, replicas)."""
        w = self.w(rank)
        if not self.tier:
            return
        held = {o: set(vs) for o, vs in w.replicas.items() if vs}
        if w.committed is not None and w.committed in w.local:
            held[rank] = {w.committed}
        self.files[(w.node, rank)] = held

    def truth_avail(self, rank: int) -> set[int]:
        """Ground truth, independent of the facts: what live memory holds of ``rank``."""
        out = set(self.w(rank).local) if self.w(rank).alive else set()
        for w in self.workers.values():
            if w.alive:
                out |= w.replicas.get(rank, set())
        for (node, _), held in self.files.items():  # R11: a survivor on that node can adopt it
            if node not in self.dead_nodes:
                out |= {v for v in held.get(rank, set())
                        if any(self.w(r).alive and self.w(r).node == node and v in self.w(r).local
                               for r in range(self.world) if r != rank)}
        if not self.policy.resume_beyond_committed:
            cap = max((w.committed for w in self.workers.values()
                       if w.alive and w.committed is not None and w in self._members()), default=-1)
            out = {v for v in out if v <= cap}
        return out

    def _members(self) -> list[W]:
        return [self.w(r) for r in range(self.world)]

    def mirror(self, owner: int, version: int, holder: W) -> None:
        held = holder.replicas.setdefault(owner, set())
        keep = {holder.committed} if holder.committed in held else set(sorted(held)[-1:])
        holder.replicas[owner] = {version} | keep

    # --- training ------------------------------------------------------------------
    @precondition(lambda self: self.healthy())
    @rule(fail_owners=st.sets(st.integers(0, 7), max_size=2))
    def step(self, fail_owners: set[int]) -> None:
        v = max(self.w(0).local) + 1
        for r in range(self.world):
            self.w(r).local.add(v)
        for o in range(self.world):
            for i, h in enumerate(self.placement[o]):
                if not (o in fail_owners and i == 0):
                    self.mirror(o, v, self.w(h))
        if not any(o < self.world for o in fail_owners):
            self.committed = v
            for r in range(self.world):
                self.w(r).committed = v
                self.w(r).local = {x for x in self.w(r).local if x >= v}

    @precondition(lambda self: self.healthy())
    @rule(ranks=st.sets(st.integers(0, 7), min_size=1))
    def partial_step(self, ranks: set[int]) -> None:
        """Some ranks captured the next version, then the step broke."""
        v = max(self.w(0).local) + 1
        for r in ranks & set(range(self.world)):
            self.w(r).local.add(v)
        self.broken = True

    @precondition(lambda self: self.healthy())
    @rule()
    def take_snapshot(self) -> None:
        self.snapshot = self.committed

    # --- faults and spares -----------------------------------------------------------
    @rule(rank=st.integers(0, 7))
    def kill_rank(self, rank: int) -> None:
        rank %= self.world
        if sum(self.w(r).alive for r in range(self.world)) > 1 and self.w(rank).alive:
            self.w(rank).alive = False
            self.leave_files(rank)

    @rule(rank=st.integers(0, 7))
    def kill_rank_and_its_holders(self, rank: int) -> None:
        """A rank and every holder of its image die at once (more than K in one placement group):
        only the node-local tier, or the disk, can have it."""
        rank %= self.world
        victims = [rank, *self.placement[rank]]
        if sum(self.w(r).alive for r in range(self.world) if r not in victims) >= 1:
            for r in victims:
                if self.w(r).alive:
                    self.w(r).alive = False
                    self.leave_files(r)

    @rule(rank=st.integers(0, 7))
    def gpu_fails(self, rank: int) -> None:
        """The rank's GPU fails and its node has no other good GPU free (its exit record says so)."""
        rank %= self.world
        if sum(self.w(r).alive for r in range(self.world)) > 1 and self.w(rank).alive:
            self.w(rank).alive = False
            self.gpu_failed.add(self.rank_worker[rank])
            self.leave_files(rank)

    @rule(rank=st.integers(0, 7))
    def kill_node(self, rank: int) -> None:
        node = self.w(rank % self.world).node
        if all(self.w(r).node == node or not self.w(r).alive for r in range(self.world)):
            return  # keep one survivor: with none, there is nobody to plan
        self.dead_nodes.add(node)
        for w in self.workers.values():
            if w.node == node:
                w.alive = False
        self.files = {k: v for k, v in self.files.items() if k[0] != node}
        self.spares = {s: n for s, n in self.spares.items() if n != node}

    @rule(on_rank_node=st.booleans(), rank=st.integers(0, 7))
    def add_spare(self, on_rank_node: bool, rank: int) -> None:
        node = self.w(rank % self.world).node if on_rank_node else f"s{self.n_spares}"
        if node not in self.dead_nodes:
            self.spares[f"{node}/spare{self.n_spares}"] = node
            self.n_spares += 1

    # --- recovery --------------------------------------------------------------------
    @precondition(lambda self: not self.ended and (self.broken or self.in_recovery or bool(self.lost())))
    @rule(interrupt=st.booleans())
    def recover(self, interrupt: bool) -> None:
        facts = self.facts()
        decision = plan_recovery(facts)
        event(type(decision).__name__ + (" (re-plan during recovery)" if self.in_recovery else ""))
        avail = [self.truth_avail(r) for r in range(self.world)]
        common = set.intersection(*avail)
        needing = [o for o in range(self.world) if not (self.w(o).alive and self.w(o).local)]
        covered = all(any(self.w(h).alive and self.w(h).local for h in self.placement[o])
                      for o in needing)
        if covered:  # within K per placement group: memory always suffices
            assert self.committed in common
            assert isinstance(decision, (RecoveryPlan, WaitForReplacement))
        if isinstance(decision, Unrecoverable):
            assert not common and self.snapshot is None, "never unrecoverable while a copy of a version is at hand"
            self.ended = True
            return
        if isinstance(decision, WaitForReplacement):
            stuck = [r for r in self.lost()
                     if self.w(r).node in self.dead_nodes or self.rank_worker[r] in self.gpu_failed]
            assert len(stuck) > len(self.spares) and decision.generation == self.gen
            return
        assert decision.generation == self.gen + 1
        adopted: set[tuple[str, int]] = set()
        if isinstance(decision, RecoveryPlan):
            adopted = {(a.worker_id, a.owner) for a in decision.adoptions}
            event(f"images adopted from a node's memory: {min(len(adopted), 2)}")
            for a in decision.adoptions:  # R11: a survivor on the copy's node, which is really there
                w = self.workers[a.worker_id]
                assert w.alive and w.node == a.node_id and a.version in w.local
                assert a.version in self.files[(a.node_id, a.holder)][a.owner]
        self.gen = decision.generation
        self._adopt(decision.rank_to_worker, decision)
        if isinstance(decision, DiskFallback):
            assert not common and decision.snapshot_step == self.snapshot
            self.last_resume = decision.snapshot_step
            self._finish(decision.snapshot_step)
            return
        r = decision.resume_version
        self.last_resume = r
        if not common and decision.initial_ranks:
            # R0 with nothing left in memory: every rank rebuilds the initial state, which is only
            # right while nothing beyond it was ever committed (the sim's initial capture is v0).
            assert r == 0 and self.committed == 0 and set(decision.initial_ranks) == set(range(self.world))
            self._finish(0)
            return
        assert common and r == max(common), "newest version every rank can get"
        assert r >= self.committed, "committed or newer"
        for t in decision.transfers:
            for s in t.stripes:  # every source really holds R of that owner
                assert r in self.workers[s.source].replicas.get(t.owner, set()) or (s.source, t.owner) in adopted
        for rank in range(self.world):
            if rank not in {t.owner for t in decision.transfers}:
                assert r in self.w(rank).local
        for b in decision.rollbacks:
            w = self.workers[b.worker_id]
            w.local = {x for x in w.local if x <= r}
        if interrupt and decision.transfers:
            self.in_recovery = True   # replacements joined empty; the next fault re-plans at g+2
            return
        self._finish(r)

    def _adopt(self, rank_to_worker: dict[int, str], decision: RecoveryPlan | DiskFallback) -> None:
        for a in decision.assignments:
            if a.source == "survivor":
                assert self.rank_worker[a.rank] == a.worker_id
                continue
            assert a.node_id not in self.dead_nodes
            assert a.source == "spare" or self.rank_worker[a.rank] not in self.gpu_failed, "respawn on its bad GPU"
            if a.source == "spare":
                assert self.spares.pop(a.worker_id) == a.node_id
            self.workers[a.worker_id] = W(a.node_id)
            self.rank_worker[a.rank] = a.worker_id
            self.files.pop((a.node_id, a.rank), None)  # a new process of that rank there owns those files
        assert rank_to_worker == self.rank_worker

    def _finish(self, version: int) -> None:
        """Transfers done, mirrors re-placed: every image at ``version``, K-replicated."""
        for r in range(self.world):
            w = self.w(r)
            w.local, w.committed = {version}, version
            w.replicas = {o: {version} for o in range(self.world) if r in self.placement[o]}
        self.committed = version
        self.broken = self.in_recovery = False

    @rule()
    def wait(self) -> None:
        """Time passes (the only move once the job has ended)."""

    @invariant()
    def commit_invariant(self) -> None:
        """While healthy: the committed version of every image is held by all K holders."""
        if getattr(self, "world", None) is None or not self.healthy():
            return
        for o in range(self.world):
            assert self.committed in self.w(o).local
            for h in self.placement[o]:
                assert self.committed in self.w(h).replicas[o]


JobSim.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
TestJobSim = JobSim.TestCase


def test_failure_during_recovery_replans_at_g_plus_2() -> None:
    """Rank 1 dies at gen 4; its spare dies mid-transfer; gen 5 facts -> gen 6 plan."""
    placement = {0: (1, 2), 1: (2, 3), 2: (3, 0), 3: (0, 1)}

    def report(wid: str, rank: int, held: dict[int, set[int]], local: frozenset[int] = frozenset({10})) -> WorkerReport:
        reps = tuple(ReplicaFact(o, v, 6) for o, vs in sorted(held.items()) for v in sorted(vs))
        return WorkerReport(wid, max(local, default=None), min(local) if local else None, local, reps)

    survivors = {0: {2: {10}, 3: {10}}, 2: {0: {10}, 1: {10}}, 3: {1: {10}, 2: {10}}}
    members = tuple(RankSlot(r, Worker(f"n{r}/w", f"n{r}"), r != 1) for r in range(4))
    f4 = PlanningFacts("j", 4, 4, members, tuple(report(f"n{r}/w", r, h) for r, h in survivors.items()),
                       (Worker("s/a", "s"), Worker("t/b", "t")), placement, None, frozenset({"n1"}))
    p5 = plan_recovery(f4)
    assert isinstance(p5, RecoveryPlan) and p5.generation == 5 and p5.rank_to_worker[1] == "s/a"
    assert [t.holders for t in p5.transfers] == [("n2/w", "n3/w")]
    # the spare joined (empty) and then died, and rank 3's node went down with it
    members5 = tuple(RankSlot(a.rank, Worker(a.worker_id, a.node_id), a.rank in (0, 2))
                     for a in p5.assignments)
    f5 = PlanningFacts("j", p5.generation, 4, members5,
                       tuple(report(f"n{r}/w", r, survivors[r]) for r in (0, 2)),
                       (Worker("t/b", "t"),), placement, None, frozenset({"n1", "n3", "s"}))
    p6 = plan_recovery(f5)
    assert isinstance(p6, WaitForReplacement) and p6.generation == 5  # two lost, one spare
    p6 = plan_recovery(replace(f5, spares=f5.spares + (Worker("u/c", "u"),)))
    assert isinstance(p6, RecoveryPlan) and p6.generation == 6 and p6.resume_version == 10
    assert p6.lost_ranks == (1, 3) and {t.owner: t.holders for t in p6.transfers} == {1: ("n2/w",), 3: ("n0/w",)}


def test_only_an_empty_replacement_left_never_restarts_past_a_commit() -> None:
    """Found by the simulation: a recovery interrupted by a further failure leaves only replacements
    that restored nothing, so no report shows the commit. R0 (a fresh start) must then apply only
    while the last plan resumed at version 0; past that it would lose the progress silently."""
    members = (RankSlot(0, Worker("n0/r", "n0"), True), RankSlot(1, Worker("n1/w1", "n1"), False))
    empty = WorkerReport("n0/r", None, None, frozenset(), ())

    def facts(last_resume: int | None) -> PlanningFacts:
        return PlanningFacts("j", 1, 2, members, (empty,), (), {0: (1,), 1: (0,)}, None, frozenset(),
                             last_resume=last_resume)

    assert isinstance(plan_recovery(facts(5)), Unrecoverable)
    fresh = plan_recovery(facts(0))
    assert isinstance(fresh, RecoveryPlan) and fresh.resume_version == 0 and set(fresh.initial_ranks) == {0, 1}
    assert isinstance(plan_recovery(facts(None)), RecoveryPlan)  # generation 0: nothing was ever resumed
