"""Turn a :class:`JobView` into validated :class:`PlanningFacts` (pure).

Why a sanitising step between etcd and the planner: ``PlanningFacts``
rejects inconsistent input with a ``ConfigError``, which is right for a pure
function but wrong for a leader: one malformed report (a bug, a stale
incarnation, a replica listed twice after a rollback) must not crash the
coordinator or end a job whose images are all in memory. So every report is
checked here against the membership; what cannot be trusted is *excluded*,
and each exclusion is returned as a note the leader logs. The planner then
only ever sees facts that validate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ckptless.mirror import compute_placement
from ckptless.recovery.facts import (
    MAX_VERSIONS_PER_OWNER,
    NodeLocalCopy,
    NodeLocalImage,
    PlanningFacts,
    PlanPolicy,
    RankSlot,
    ReplicaFact,
    Worker,
    WorkerReport,
)
from ckptless.recovery.decision import Assignment, Decision, DiskFallback, RecoveryPlan
from ckptless.recovery.plan import plan_recovery
from ckptless.recovery.view import ExitRecord, JobView, ReportRecord


def empty_report(worker_id: str) -> WorkerReport:
    """What a worker that holds nothing (a fresh replacement, an excluded report) contributes."""
    return WorkerReport(worker_id, None, None)


def _clean_replicas(rep: WorkerReport, rank: int, world: int, notes: list[str]) -> tuple[ReplicaFact, ...]:
    """Drop replica facts that cannot be right; keep each (owner, version) once, newest two per owner."""
    seen: dict[tuple[int, int], ReplicaFact] = {}
    conflicting: set[tuple[int, int]] = set()
    for f in rep.replicas:
        if not 0 <= f.owner < world or f.owner == rank:
            notes.append(f"rank {rank}: ignoring replica of owner {f.owner} (outside the world or its own rank)")
            continue
        key = (f.owner, f.version)
        prev = seen.get(key)
        if prev is not None and prev.n_chunks != f.n_chunks:
            notes.append(f"rank {rank}: owner {f.owner} v{f.version} listed with {prev.n_chunks} and "
                         f"{f.n_chunks} chunks; ignoring both")
            conflicting.add(key)
        seen.setdefault(key, f)
    by_owner: dict[int, list[ReplicaFact]] = {}
    for key, f in seen.items():
        if key not in conflicting:
            by_owner.setdefault(f.owner, []).append(f)
    out: list[ReplicaFact] = []
    for owner in sorted(by_owner):
        facts = sorted(by_owner[owner], key=lambda x: x.version)[-MAX_VERSIONS_PER_OWNER:]
        out += facts
    return tuple(out)


def sanitize_reports(
    view: JobView, lost: frozenset[int], notes: list[str],
) -> dict[int, WorkerReport]:
    """One trustworthy report per live rank (an empty one where the real one cannot be used)."""
    m = view.membership
    assert m is not None
    world = m.world_size
    out: dict[int, WorkerReport] = {}
    for a in m.ranks:
        if a.rank in lost:
            continue
        rec: ReportRecord | None = view.reports.get(a.rank)
        if rec is None or rec.report.worker_id != a.worker_id:
            if a.rank in view.malformed_reports:
                notes.append(f"rank {a.rank}: its report is malformed; planning as if it holds nothing")
            elif rec is not None:
                notes.append(f"rank {a.rank}: report from {rec.report.worker_id}, not its current worker "
                             f"{a.worker_id}; planning as if it holds nothing")
            out[a.rank] = empty_report(a.worker_id)
            continue
        rep = rec.report
        replicas = _clean_replicas(rep, a.rank, world, notes)
        out[a.rank] = WorkerReport(rep.worker_id, rep.newest_captured, rep.committed, rep.local_versions, replicas,
                                   tuple((v, k) for v, k in rep.own_layouts if v in rep.local_versions),
                                   rep.can_host)
    # Holders must agree on an image's size; a disagreement means one of them is wrong: trust neither.
    sizes: dict[tuple[int, int], set[int]] = {}
    for rep in out.values():
        for f in rep.replicas:
            sizes.setdefault((f.owner, f.version), set()).add(f.n_chunks)
    conflicts = {k for k, v in sizes.items() if len(v) > 1}
    if conflicts:
        for owner, version in sorted(conflicts):
            notes.append(f"holders disagree on the size of owner {owner} v{version}; not using that version")
        out = {r: replace(rep, replicas=tuple(f for f in rep.replicas if (f.owner, f.version) not in conflicts))
               for r, rep in out.items()}
    return out


def node_local_images(view: JobView, lost: frozenset[int], notes: list[str]) -> tuple[NodeLocalImage, ...]:
    """The node-local own images lost ranks left, as their agents verified them (exit records).

    Only the exit record of the worker that held the rank in this generation
    counts: a replacement that failed to restore from its node-local image
    is alive (not lost), and an older incarnation's record says nothing
    about what is on that node now.
    """
    m = view.membership
    assert m is not None
    out = []
    hosted = m.hosted
    for rank in sorted(lost):
        if rank in hosted:  # no process of its own: the exit record there is its host's (its image is a replica)
            continue
        rec = view.current_exit(rank)
        if rec is None or rec.local_image is None:
            continue
        img = rec.local_image
        node = m.worker_of(rank).node_id
        if img.rank != rank or img.node_id != node:
            notes.append(f"rank {rank}: node-local image reported for rank {img.rank} on {img.node_id}, "
                         f"but the rank ran on {node}; not using it")
            continue
        out.append(img)
    return tuple(out)


def node_copies(view: JobView, dead_nodes: frozenset[str],
                bad: frozenset[tuple[str, int, int, int]] = frozenset()) -> tuple[NodeLocalCopy, ...]:
    """R11's facts: every copy dead workers left in the node-local tier of a node still alive.

    From the newest exit record of each rank on each node (its own image and the replicas it held, as
    its agent verified them; a later record of the rank from another node does not hide it: a spare
    that took the rank and died elsewhere left those files alone), unless a later process of that
    rank runs on that node now and has resumed: it
    owns those files (its mirror rounds rewrite the replicas it re-attached, and its first commit
    removes older own images). One that has not resumed (``view.fresh``: a respawn whose restore
    failed, say) has changed nothing yet. Any other process leaves them alone: the files are named
    by (job, node, rank), and a node's files are removed only once its agent is gone or the job
    ended. A hosted rank has no process at all, so its records stay good. ``bad``: copies a worker
    failed to adopt (gone, or corrupt since its agent checked): left out, so a re-plan does not pick
    them again. O(records + copies).
    """
    m = view.membership
    assert m is not None
    out: dict[tuple[str, int, int, int], NodeLocalCopy] = {}
    fresh = view.fresh
    newest: dict[tuple[int, str], ExitRecord] = {}  # (rank, node) -> its newest record (every incarnation's)
    for rec in (*view.exits.values(), *view.worker_exits.values()):
        prev = newest.get((rec.rank, rec.node_id))
        if rec.rank >= 0 and (prev is None or (rec.time, rec.worker_id) > (prev.time, prev.worker_id)):
            newest[(rec.rank, rec.node_id)] = rec
    for (rank, _), rec in sorted(newest.items()):
        if rec.node_id not in view.live_nodes or rec.node_id in dead_nodes or not 0 <= rank < m.world_size:
            continue
        now = m.worker_of(rank)
        if (now.source != "hosted" and now.worker_id != rec.worker_id and now.node_id == rec.node_id
                and rank not in fresh):
            continue
        img = rec.local_image
        own = () if img is None or img.rank != rank else (
            NodeLocalCopy(rank, rank, rec.node_id, img.version, img.n_chunks, img.generation),)
        for c in (*own, *rec.local_replicas):
            if c.holder == rank and c.node_id == rec.node_id and c.owner < m.world_size and c.key not in bad:
                out.setdefault(c.key, c)
    return tuple(out[k] for k in sorted(out))


def no_respawn_ranks(view: JobView, lost: frozenset[int]) -> frozenset[int]:
    """Lost ranks whose node said it cannot start them again (their GPU failed and no other good one
    is free there). Only the record of the worker that held the rank now counts, as for node-local
    images: an older incarnation's says nothing about the node's GPUs today."""
    out = set()
    for rank in lost:
        rec = view.current_exit(rank)
        if rec is not None and not rec.respawnable:
            out.add(rank)
    return frozenset(out)


def build_facts(
    view: JobView,
    job_id: str,
    lost: frozenset[int],
    replicas: int,
    placement: str,
    snapshot_step: int | None,
    policy: PlanPolicy | None = None,
    bad_copies: frozenset[tuple[str, int, int, int]] = frozenset(),
) -> tuple[PlanningFacts, list[str]]:
    """Facts for :func:`ckptless.recovery.plan.plan_recovery`, plus notes on what was excluded."""
    m = view.membership
    assert m is not None, "no membership: nothing to plan"
    notes: list[str] = []
    dead_nodes = view.missing_nodes
    # A rank on a missing node is lost or it reported (its workers outlived the agent's lease). A hosted
    # rank (fewer ranks) is lost to any further incident: no process of its own reports or holds it.
    lost = frozenset(lost | {r for r in view.ranks_on(dead_nodes) if r not in view.reports} | set(m.hosted))
    reports = sanitize_reports(view, lost, notes)
    node_of = [m.worker_of(r).node_id for r in range(m.world_size)]
    k = min(replicas, m.world_size - 1)
    holders: Mapping[int, tuple[int, ...]] = {}
    if k > 0:
        pl = compute_placement(m.world_size, k, placement, node_of)
        holders = {o: pl.holders(o) for o in range(m.world_size)}
    spares = tuple(w for w in view.usable_spares() if w.worker_id not in {a.worker_id for a in m.ranks})
    # Ranks alive on a node whose key is gone (a paused agent) are survivors, not dead-node members.
    alive_nodes_of_survivors = {m.worker_of(r).node_id for r in reports}
    facts = PlanningFacts(
        job_id=job_id,
        generation=m.generation,
        world_size=m.world_size,
        members=tuple(RankSlot(a.rank, Worker(_slot_worker(a), a.node_id), a.rank not in lost) for a in m.ranks),
        reports=tuple(reports[r] for r in sorted(reports)),
        spares=spares,
        placement=holders,
        snapshot_step=snapshot_step,
        dead_nodes=frozenset(n for n in dead_nodes if n not in alive_nodes_of_survivors),
        policy=policy or PlanPolicy(),
        node_local=node_local_images(view, lost, notes),
        last_resume=_last_resume(m.decision),
        # A hosted rank's "node" is its host's, which runs a rank already (no device is free there).
        no_respawn=no_respawn_ranks(view, lost) | frozenset(m.hosted),
        node_copies=node_copies(view, dead_nodes, bad_copies | view.bad_copies),
    )
    return facts, notes


def _slot_worker(a: Assignment) -> str:
    """The worker id of a rank's slot: a hosted rank's names its host and itself (ids are unique per slot)."""
    return f"{a.worker_id}#hosted{a.rank}" if a.source == "hosted" else a.worker_id


def _last_resume(decision: object) -> int | None:
    """The version the current generation's plan resumed at (None: generation 0)."""
    if isinstance(decision, RecoveryPlan):
        return decision.resume_version
    if isinstance(decision, DiskFallback):
        return decision.snapshot_step
    return None


def keep_fresh_sources(decision: Decision, view: JobView) -> Decision:
    """A replacement that never resumed stays marked as one in the next plan.

    Why: the planner calls every live member a survivor, but a respawn or
    spare that has not restored yet holds nothing; keeping its source lets the
    leader plan a further failure without waiting for its (empty) report.
    """
    if not isinstance(decision, (RecoveryPlan, DiskFallback)) or view.membership is None:
        return decision
    fresh = {view.membership.worker_of(r).worker_id: view.membership.worker_of(r).source for r in view.fresh}
    if not fresh:
        return decision
    assignments = tuple(
        Assignment(a.rank, a.worker_id, a.node_id, fresh[a.worker_id])
        if a.source == "survivor" and a.worker_id in fresh else a
        for a in decision.assignments)
    return replace(decision, assignments=assignments)


def plan_from_view(
    view: JobView, job_id: str, lost: frozenset[int], replicas: int, placement: str,
    snapshot_step: int | None, policy: PlanPolicy | None = None,
    bad_copies: frozenset[tuple[str, int, int, int]] = frozenset(),
) -> tuple[Decision, list[str]]:
    """Facts from the view, the pure planner, and the fresh-source rule: what the leader publishes."""
    facts, notes = build_facts(view, job_id, lost, replicas, placement, snapshot_step, policy, bad_copies)
    return keep_fresh_sources(plan_recovery(facts), view), notes
