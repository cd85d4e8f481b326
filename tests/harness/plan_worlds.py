"""Random and worked worlds for the recovery planner's tests (tests/unit/test_recovery_plan.py, and the
node-local rule in tests/e2e/test_node_local.py).

Each random world: W ranks on nodes, a ring placement with K mirrors, a committed
version C, per-rank local images, per-holder replicas (honest or arbitrary),
a random failure set (ranks and whole nodes, some ranks whose node cannot restart
them after their GPU failed), spares and maybe a snapshot.
``oracle_avail`` recomputes which versions every rank can get, deliberately naively.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ckptless.recovery import PlanningFacts, PlanPolicy, RankSlot, ReplicaFact, Worker, WorkerReport

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ring(world: int, k: int) -> dict[int, tuple[int, ...]]:
    return {r: tuple((r + i) % world for i in range(1, k + 1)) for r in range(world)}


@dataclass(frozen=True)
class World:
    facts: PlanningFacts
    committed: int
    honest: bool


@st.composite
def worlds(draw: st.DrawFn, honest: bool | None = None) -> World:
    w = draw(st.integers(2, 64))
    k = draw(st.integers(1, min(3, w - 1)))
    per_node = draw(st.integers(1, 4))
    node = {r: f"n{r // per_node}" for r in range(w)}
    placement = ring(w, k)
    c = draw(st.integers(0, 12))
    is_honest = draw(st.booleans()) if honest is None else honest
    # per-rank detail from one seeded Random: keeps generation cheap for W=64
    rnd = random.Random(draw(st.integers(0, 2**32)))
    committed = {r: rnd.choice([c, max(0, c - 1)]) for r in range(w)}
    newest = {r: c + rnd.randint(0, 2) for r in range(w)}
    local = {r: frozenset(range(committed[r], newest[r] + 1)) for r in range(w)}
    size = {r: rnd.randint(0, 40) for r in range(w)}
    # failures: whole nodes and single ranks
    nodes = sorted(set(node.values()))
    dead_nodes = frozenset(draw(st.sets(st.sampled_from(nodes), max_size=2)))
    if len(dead_nodes) == len(nodes):
        dead_nodes = frozenset(sorted(dead_nodes)[1:])
    killed = draw(st.sets(st.integers(0, w - 1), max_size=min(w - 1, 5)))
    lost = {r for r in range(w) if r in killed or node[r] in dead_nodes}
    if len(lost) == w:
        lost.discard(min(r for r in range(w) if node[r] not in dead_nodes))
    # replicas held by live holders
    held: dict[int, list[ReplicaFact]] = {r: [] for r in range(w)}
    for owner in range(w):
        for holder in placement[owner]:
            if holder in lost:
                continue
            if is_honest:
                versions = {c, newest[owner]}
            else:
                pool = sorted(range(max(0, c - 2), c + 3))
                versions = set(rnd.sample(pool, rnd.randint(0, 2)))
            held[holder] += [ReplicaFact(owner, v, size[owner] + v % 3) for v in sorted(versions)]
    members = tuple(RankSlot(r, Worker(f"{node[r]}/w{r}", node[r]), r not in lost) for r in range(w))
    reports = tuple(WorkerReport(f"{node[r]}/w{r}", newest[r], committed[r], local[r], tuple(held[r]))
                    for r in range(w) if r not in lost)
    spare_nodes = nodes + ["s0", "s1"]
    spares = tuple(Worker(f"{n}/spare{i}", n) for i, n in enumerate(
        draw(st.lists(st.sampled_from(spare_nodes), max_size=4))))
    snapshot = None if draw(st.integers(0, 4)) == 0 else draw(st.integers(0, c))
    policy = PlanPolicy(prefer=draw(st.sampled_from(["spare", "respawn"])),
                        resume_beyond_committed=draw(st.booleans()))
    # lost ranks whose GPU failed with no other good one free on their (live) node: never respawned there
    gpu_lost = sorted(r for r in lost if node[r] not in dead_nodes)
    no_respawn = frozenset(draw(st.sets(st.sampled_from(gpu_lost), max_size=3))) if gpu_lost else frozenset()
    facts = PlanningFacts("job", draw(st.integers(0, 5)), w, members, reports, spares, placement,
                          snapshot, dead_nodes, policy, no_respawn=no_respawn)
    return World(facts, c, is_honest)


def oracle_avail(f: PlanningFacts) -> dict[int, set[int]]:
    alive = {s.worker.worker_id: s.rank for s in f.members if s.alive}
    avail: dict[int, set[int]] = {r: set() for r in range(f.world_size)}
    for rep in f.reports:
        avail[alive[rep.worker_id]] |= rep.local_versions
        for rf in rep.replicas:
            avail[rf.owner].add(rf.version)
    if not f.policy.resume_beyond_committed:
        cap = max((r.committed for r in f.reports if r.committed is not None), default=-1)
        avail = {r: {v for v in vs if v <= cap} for r, vs in avail.items()}
    return avail


# --- the worked example of docs/recovery.md ------------------------------------------------------------
def example_facts(spares: tuple[Worker, ...] = (), dead: frozenset[str] = frozenset(),
                  prefer: str = "spare", snapshot: int | None = 90) -> PlanningFacts:
    """4 ranks on 2 nodes, K=1 ring; rank 1 (node a) dies after capturing 101."""
    node = {0: "a", 1: "a", 2: "b", 3: "b"}
    members = tuple(RankSlot(r, Worker(f"{node[r]}/w{r}", node[r]), r != 1) for r in range(4))
    reps = {
        0: WorkerReport("a/w0", 101, 100, frozenset({100, 101}), (ReplicaFact(3, 100, 8), ReplicaFact(3, 101, 8))),
        2: WorkerReport("b/w2", 100, 100, frozenset({100}), (ReplicaFact(1, 99, 10), ReplicaFact(1, 100, 10))),
        3: WorkerReport("b/w3", 101, 100, frozenset({100, 101}), (ReplicaFact(2, 100, 8),)),
    }
    return PlanningFacts("demo", 7, 4, members, tuple(reps.values()), spares, ring(4, 1),
                         snapshot, dead, PlanPolicy(prefer=prefer))  # type: ignore[arg-type]
