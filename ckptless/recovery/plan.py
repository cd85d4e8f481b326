"""Pure recovery planning: reported facts in, one decision out.

Why pure: the leader must be able to re-plan at any moment (a second failure
during recovery simply means "plan again from the updated facts at the next
generation"), tests must be able to enumerate thousands of worlds, and two
leaders given the same facts must produce the same plan. So this module has
no clock, no I/O, no randomness, and normalises input order before deciding.

The rules (numbered as in docs/recovery.md):

R1  Survivors keep their rank numbers; only lost ranks get new workers.
R2  A lost rank goes to a warm spare or a respawn on its own (live) node,
    per ``policy.prefer`` (never a respawn for a rank in ``no_respawn``: its
    GPU failed and its node has no other good one free; it takes a spare or
    waits, exactly like a rank of a lost node); a spare standing by for that very rank (its objects
    already built) comes first, then a pre-built ``any_rank`` spare whose
    standby rank's image has this rank's layout key (it takes the rank with its
    objects as built: ``adopt_prebuilt``), then spares are scored to keep a rank
    off the nodes of its own mirror holders, then off nodes already running ranks.
R3  avail(r) = versions r's own live worker holds locally, plus versions any
    *other* live worker holds complete for owner r, plus (R9) the version of
    the node-local image a lost r left, when r respawns on that node, plus
    (R11) the versions of r's copies a live node kept that a worker there can adopt.
R4  R = max of the intersection of avail(r) over all ranks (capped at the
    newest reported commit unless ``resume_beyond_committed``).
R5  Ranks whose worker holds R locally and captured past R roll back.
R6  Every rank whose worker lacks R locally receives R, striped in balanced
    contiguous chunk ranges over all live holders of (r, R), each stripe with
    all other such holders as ordered fallbacks.
R7  No common version: DiskFallback to the newest snapshot, else
    Unrecoverable. Unrecoverable wins over WaitForReplacement; otherwise a
    missing replacement yields WaitForReplacement at the *same* generation.
R0  Before the first commit (no live worker reports a committed version,
    no replica exists anywhere, and the last plan did not resume beyond
    version 0) a loss costs nothing that a restart would not redo: the job resumes at the oldest version every survivor holds locally
    (its initial capture), and ranks without it start from the state their
    fresh process builds (``initial_ranks``), exactly as a full restart would.
    Preferred over a disk snapshot, which cannot exist before a commit.
R9  Node-local tier: a lost rank assigned a respawn on its own node, whose
    agent verified a node-local copy of its own image at R (``facts.node_local``),
    restores R from that copy (a ``LocalRestore``); its holders send nothing
    for it. A spare, or a worker on another node, never uses it.
R10 Fewer ranks (``policy.lost_node == "shrink"``): when R2 cannot place every lost
    rank, no lost rank takes a spare: one whose node kept its own image of R
    restarts there from it (R9), every other is hosted by a process holding
    its image of R (:mod:`ckptless.recovery.shrink`); nothing is transferred.
R11 Node-local copies (``facts.node_copies``): what dead workers left in the
    node-local tier of a live node (their own images, the replicas they held)
    counts for R3 like a replica when a worker of the new generation on that
    node holds that version of its own state; for an image no live process
    holds at R, such a worker adopts the copy (``RecoveryPlan.adoptions``) and
    serves its stripes (R6) or hosts its rank (R10)
    (:mod:`ckptless.recovery.nodecopies`).

What a decision looks like (:class:`RecoveryPlan`, :class:`DiskFallback`, ...)
is :mod:`ckptless.recovery.decision`; this module holds only the rules that
choose one.
"""

from __future__ import annotations

from ckptless.recovery.decision import (
    Adoption,
    Assignment,
    Decision,
    DiskFallback,
    LocalRestore,
    RecoveryPlan,
    Rollback,
    Stripe,
    Transfer,
    Unrecoverable,
    WaitForReplacement,
)
from ckptless.recovery import nodecopies
from ckptless.recovery.facts import NodeLocalImage, PlanningFacts, Worker
from ckptless.recovery.prebuilt import (fits_prebuilt, layout_index, layouts_match,  # noqa: F401 - (re-exported)
                                        prebuilt_adoptions)
from ckptless.recovery.shrink import host_lost_ranks
from ckptless.state import ReplicaSet


def respawn_worker_id(node_id: str, generation: int, rank: int) -> str:
    """The id a respawned worker must use: deterministic and unique per plan."""
    return f"{node_id}/respawn-g{generation}-r{rank}"


# --- R3/R4: which version ----------------------------------------------------
def usable_node_local(facts: PlanningFacts, assignments: list[Assignment]) -> dict[int, NodeLocalImage]:
    """R9: the node-local images the new worker of their rank can read: it respawns on that node."""
    by_rank = {a.rank: a for a in assignments}
    out: dict[int, NodeLocalImage] = {}
    for img in facts.node_local:
        a = by_rank.get(img.rank)
        if (a is not None and a.source == "respawn" and a.node_id == img.node_id
                and img.node_id not in facts.dead_nodes):
            out[img.rank] = img
    return out


def available_versions(facts: PlanningFacts, assignments: list[Assignment] | None = None) -> dict[int, frozenset[int]]:
    """R3: every version of each rank's image some live worker (or, R9, its node) can provide.

    ``assignments``: the new rank map (default: :func:`assign_replacements`'s), which decides
    whether a node-local image is usable.
    """
    if assignments is None:
        assignments = assign_replacements(facts, facts.generation + 1)[0]
    local = usable_node_local(facts, assignments)
    from_peers_of: dict[int, set[int]] = {}  # owner -> versions live holders hold (one pass: O(replicas))
    prefixes = _prefix_index(facts)
    for owner, v in _replica_index(facts):
        p = prefixes.get((owner, v))
        if p is not None and not prefix_sources(facts, owner, v, p[1]):
            continue  # the holders keep the suffix only, and no live replica has the prefix
        from_peers_of.setdefault(owner, set()).add(v)
    if facts.node_copies:  # R11: copies a live worker on their node can adopt count like a replica
        for (owner, v), copies in nodecopies.Chooser(facts, assignments, local).copies.items():
            if any(c.peers is None or prefix_sources(facts, owner, v, c.peers) for c in copies):
                from_peers_of.setdefault(owner, set()).add(v)
    avail: dict[int, frozenset[int]] = {}
    for slot in facts.members:
        own: frozenset[int] = frozenset()
        if slot.alive:
            rep = facts.report_of(slot.worker.worker_id)
            own = rep.local_versions if rep is not None else frozenset()
        elif slot.rank in local:
            own = frozenset({local[slot.rank].version})
        avail[slot.rank] = own | from_peers_of.get(slot.rank, set())
    return avail


def trusted_ceiling(facts: PlanningFacts) -> int | None:
    """R4's cap: None = no cap; else the newest reported commit (-1 if none)."""
    if facts.policy.resume_beyond_committed:
        return None
    commits = [r.committed for r in facts.reports if r.committed is not None]
    return max(commits, default=-1)


def common_versions(facts: PlanningFacts, assignments: list[Assignment] | None = None) -> frozenset[int]:
    """R4's candidates: the versions every rank can get (capped as R4 caps)."""
    avail = available_versions(facts, assignments)
    common = frozenset.intersection(*avail.values())
    cap = trusted_ceiling(facts)
    if cap is not None:
        common = frozenset(v for v in common if v <= cap)
    return common


def resume_version(facts: PlanningFacts, assignments: list[Assignment] | None = None) -> int | None:
    """R4: newest version every rank can get, or None if there is none."""
    return max(common_versions(facts, assignments), default=None)


def _replica_index(facts: PlanningFacts) -> dict[tuple[int, int], list[tuple[int, str, int]]]:
    """(owner, version) -> [(holder rank, holder worker id, n_chunks)], live holders only."""
    index: dict[tuple[int, int], list[tuple[int, str, int]]] = {}
    rank_of = {s.worker.worker_id: s.rank for s in facts.members if s.alive}
    for rep in facts.reports:
        for fact in rep.replicas:
            index.setdefault((fact.owner, fact.version), []).append(
                (rank_of[rep.worker_id], rep.worker_id, fact.n_chunks))
    for entries in index.values():
        entries.sort()
    return index


def _prefix_index(facts: PlanningFacts) -> dict[tuple[int, int], tuple[int, ReplicaSet]]:
    """(owner, version) -> (first chunk its holders keep, the replicas holding the chunks before it)
    for copies held without their replicated prefix (:mod:`ckptless.state.replication`)."""
    out: dict[tuple[int, int], tuple[int, ReplicaSet]] = {}
    for rep in facts.reports:
        for fact in rep.replicas:
            if fact.peers is not None:
                out.setdefault((fact.owner, fact.version), (fact.first_chunk, fact.peers))
    return out


def prefix_sources(facts: PlanningFacts, owner: int, version: int, peers: ReplicaSet) -> tuple[str, ...]:
    """R3/R6 for a replicated prefix: the workers of ``owner``'s live replicas that hold ``version`` of
    their own image (a survivor's committed or newer image; a replacement's once it restored), in rank
    order. O(replicas) per lost owner."""
    out: list[str] = []
    for r in peers.ranks:
        if r == owner or not 0 <= r < facts.world_size:
            continue
        slot = facts.slot(r)
        rep = facts.report_of(slot.worker.worker_id) if slot.alive else None
        if rep is not None and version in rep.local_versions:
            out.append(rep.worker_id)
    return tuple(out)


# --- R2: who takes a lost rank ---------------------------------------------------
def assign_replacements(facts: PlanningFacts, new_generation: int) -> tuple[list[Assignment], list[int]]:
    """R1+R2: the new rank map, plus the lost ranks nobody can take (yet).

    Greedy: ranks with no respawn option first (on dead nodes, or in ``no_respawn``), then in
    rank order. Deterministic, and it assigns every lost rank whenever
    ``#lost ranks without a respawn option <= #live spares``; versus an optimal matching
    it can only lose locality, never coverage.
    """
    alive_nodes = {s.worker.node_id for s in facts.members if s.alive}
    spares = sorted((w for w in facts.spares if w.node_id not in facts.dead_nodes),
                    key=lambda w: (w.node_id, w.worker_id))
    assignments = [Assignment(s.rank, s.worker.worker_id, s.worker.node_id, "survivor")
                   for s in facts.members if s.alive]
    used_nodes = set(alive_nodes)
    unassigned: list[int] = []
    layouts = layout_index(facts)
    def can_respawn(rank: int) -> bool:
        return facts.slot(rank).worker.node_id not in facts.dead_nodes and rank not in facts.no_respawn

    # Ranks that cannot respawn (node gone, or GPU failed with none left) can only take a spare:
    # serve them first so a rank that could respawn never takes the last spare from one that cannot.
    order = sorted(facts.lost_ranks, key=lambda r: (can_respawn(r), r))
    for rank in order:
        slot = facts.slot(rank)
        holder_nodes = set()
        for h in facts.placement.get(rank, ()):
            hs = facts.slot(h)
            if hs.alive:
                holder_nodes.add(hs.worker.node_id)
        respawnable = can_respawn(rank)
        spare = _best_spare(spares, holder_nodes, used_nodes, rank, layouts)
        choice: Assignment | None = None
        respawn = Assignment(rank, respawn_worker_id(slot.worker.node_id, new_generation, rank),
                             slot.worker.node_id, "respawn")
        if facts.policy.prefer == "respawn" and respawnable:
            choice = respawn
        elif spare is not None:
            spares.remove(spare)
            choice = Assignment(rank, spare.worker_id, spare.node_id, "spare")
        elif respawnable:
            choice = respawn
        if choice is None:
            unassigned.append(rank)
        else:
            used_nodes.add(choice.node_id)
            assignments.append(choice)
    assignments.sort(key=lambda a: a.rank)
    return assignments, unassigned


def _best_spare(spares: list[Worker], holder_nodes: set[str], used_nodes: set[str], rank: int,
                layouts: dict[int, dict[int, str]]) -> Worker | None:
    """Prefer a spare that already built this rank's objects (no setup on the critical path),
    then one whose built objects fit this rank (any-rank adoption), then a node without the
    rank's own mirrors (a node loss would take both), then a node running no rank yet
    (spreads load and failure domains)."""
    if not spares:
        return None
    return min(spares, key=lambda w: (w.standby_rank != rank, not fits_prebuilt(w, rank, layouts),
                                      w.node_id in holder_nodes, w.node_id in used_nodes, w.node_id, w.worker_id))


# --- R6: striping --------------------------------------------------------------
def stripe_image(owner: int, n_chunks: int, holders: tuple[str, ...], first: int = 0,
                 own: bool = False) -> tuple[Stripe, ...]:
    """Split ``[first, first + n_chunks)`` into one contiguous range per holder, sizes within 1
    (``own``: the sources serve it from their own images, see :class:`Stripe`).

    The holder order is rotated by ``owner`` so that when several owners are
    rebuilt at once, the big (first) stripes land on different holders.
    Every stripe lists all other holders as fallbacks, nearest-next first.
    """
    if not holders:
        return ()
    h = len(holders)
    shift = owner % h
    order = holders[shift:] + holders[:shift]
    base, extra = divmod(n_chunks, h)
    stripes: list[Stripe] = []
    start = first
    for i, src in enumerate(order):
        size = base + (1 if i < extra else 0)
        if size == 0:
            continue
        fallbacks = order[i + 1:] + order[:i]
        stripes.append(Stripe(owner, start, start + size, src, fallbacks, own))
        start += size
    return tuple(stripes)


# --- the planner -----------------------------------------------------------------
def plan_recovery(facts: PlanningFacts) -> Decision:
    """Decide how the job continues after the failures described by ``facts``.

    Derived only from ``facts``; input order is irrelevant (all lookups are
    sorted). Re-planning after a failure *during* recovery is the same call
    with the updated facts, whose generation is then one higher.
    """
    new_gen = facts.generation + 1
    lost = facts.lost_ranks
    # R1/R2 first: whether a node-local image (R9) is usable depends on who takes its rank.
    assignments, unassigned = assign_replacements(facts, new_gen)
    version = resume_version(facts, assignments)
    newest_seen = max((r.newest_captured for r in facts.reports if r.newest_captured is not None),
                      default=None)
    if version is None and facts.snapshot_step is None:
        initial = _initial_restart(facts)
        if initial is not None:
            if unassigned:
                return WaitForReplacement(facts.job_id, facts.generation, tuple(sorted(unassigned)), "memory",
                                          _why_waiting(facts, unassigned))
            v0, fresh = initial
            return RecoveryPlan(
                job_id=facts.job_id, generation=new_gen, assignments=tuple(assignments), lost_ranks=lost,
                resume_version=v0, rollbacks=_rollbacks_to(facts, v0), transfers=(), replace_mirrors=True,
                owners_below_k=_owners_below_k(facts),
                steps_lost=max(0, (newest_seen if newest_seen is not None else v0) - v0), initial_ranks=fresh)
    if version is None:
        missing = _ranks_without_replica(facts, assignments)
        if facts.snapshot_step is None:
            return Unrecoverable(facts.job_id, facts.generation,
                                 "no version is available for every rank in memory (of a live process, or "
                                 "of a live node: R11) and no disk snapshot exists; ranks without a usable "
                                 f"image: {list(missing)}",
                                 missing)
    if unassigned and version is not None and facts.policy.lost_node == "shrink":  # R10: fewer ranks
        # The newest common version at which no byte moves: every survivor holds it in its own memory.
        # (The newest of all may need a transfer to a survivor; an older one every survivor kept then
        # goes on at once, where the alternative is to wait for a replacement.)
        local, why_not = usable_node_local(facts, assignments), ""
        for v in sorted(common_versions(facts, assignments), reverse=True):
            shrunk, adopted, why = host_lost_ranks(facts, assignments, v, local)
            if shrunk:
                return _memory_plan(facts, new_gen, shrunk, v, newest_seen, adopted)
            why_not = why_not or why
        return WaitForReplacement(facts.job_id, facts.generation, tuple(sorted(unassigned)), "memory",
                                  f"{_why_waiting(facts, unassigned)}; not going on with fewer ranks: {why_not}")
    if unassigned:
        return WaitForReplacement(
            facts.job_id, facts.generation, tuple(sorted(unassigned)),
            "memory" if version is not None else "disk",
            _why_waiting(facts, unassigned))
    if version is None:
        assert facts.snapshot_step is not None
        missing = _ranks_without_replica(facts, assignments)
        lost_steps = max(0, (newest_seen if newest_seen is not None else facts.snapshot_step)
                         - facts.snapshot_step)
        return DiskFallback(
            facts.job_id, new_gen, tuple(assignments), lost, facts.snapshot_step,
            f"no version of every rank survives in memory (ranks {list(missing)} lack one); "
            f"restoring snapshot step {facts.snapshot_step}",
            missing, lost_steps)
    return _memory_plan(facts, new_gen, assignments, version, newest_seen)


def _why_waiting(facts: PlanningFacts, unassigned: list[int]) -> str:
    why = f"no live spare and no live node to respawn ranks {sorted(unassigned)} on"
    gpu = sorted(set(unassigned) & facts.no_respawn)
    if gpu:
        why += f" (ranks {gpu}: their GPU failed and their node has no other good GPU free)"
    return why


def _memory_plan(facts: PlanningFacts, new_gen: int, assignments: list[Assignment],
                 version: int, newest_seen: int | None, adopted: list[Adoption] | None = None) -> RecoveryPlan:
    index = _replica_index(facts)
    prefixes = _prefix_index(facts)
    worker_of = {a.rank: a.worker_id for a in assignments}
    local = usable_node_local(facts, assignments)
    rollbacks: list[Rollback] = []
    transfers: list[Transfer] = []
    node_local: list[LocalRestore] = []
    adoptions = list(adopted or ())  # R11 (a host's, from R10), and below: a holder for an image none holds
    chooser = None
    hosted = {a.rank for a in assignments if a.source == "hosted"}
    for rank in range(facts.world_size):
        if rank in hosted:  # R10: its host reads the rank's own state from the copy it holds
            continue
        slot = facts.slot(rank)
        rep = facts.report_of(slot.worker.worker_id) if slot.alive else None
        if rep is not None and version in rep.local_versions:
            assert rep.newest_captured is not None
            if rep.newest_captured > version:
                rollbacks.append(Rollback(rank, rep.worker_id, rep.newest_captured, version))
            continue
        img = local.get(rank)
        if img is not None and img.version == version:  # R9: from this node's memory, not the network
            node_local.append(LocalRestore(rank, worker_of[rank], img.node_id, version, img.n_chunks, img.generation))
            continue
        entries = index.get((rank, version), [])
        prefix = prefixes.get((rank, version))
        if not entries:  # R11: no live process holds it; a worker on the node that keeps a copy adopts it
            if chooser is None:
                chooser = nodecopies.Chooser(facts, assignments, local)
            picked = chooser.choose((c, w) for c, w in chooser.candidates(rank, version)
                                    if c.peers is None or prefix_sources(facts, rank, version, c.peers))
            assert picked is not None, f"rank {rank} v{version} was counted available (R3)"
            copy, adopter = picked
            adoptions.append(nodecopies.adoption(copy, adopter))
            entries = [(adopter.rank, adopter.worker_id, copy.n_chunks)]
            prefix = None if copy.peers is None else (copy.first_chunk, copy.peers)
        holders = tuple(w for (_, w, _) in entries)
        n_chunks = entries[0][2]
        if prefix is None:
            stripes = stripe_image(rank, n_chunks, holders)
        else:  # the suffix from the holders (first: one of them sends the manifest), the prefix from replicas
            first, peers = prefix
            stripes = (stripe_image(rank, n_chunks - first, holders, first)
                       + stripe_image(rank, first, prefix_sources(facts, rank, version, peers), 0, own=True))
        transfers.append(Transfer(rank, worker_of[rank], version, n_chunks, holders, stripes))
    lost = facts.lost_ranks
    below_k = _owners_below_k(facts)
    steps_lost = max(0, (newest_seen if newest_seen is not None else version) - version)
    received = {t.owner for t in transfers}  # an adopted spare must receive the rank's image
    adopt = tuple(r for r in prebuilt_adoptions(facts, assignments, version) if r in received)
    return RecoveryPlan(
        job_id=facts.job_id, generation=new_gen, assignments=tuple(assignments),
        lost_ranks=lost, resume_version=version, rollbacks=tuple(rollbacks),
        transfers=tuple(transfers), replace_mirrors=bool(lost or below_k or transfers),
        owners_below_k=below_k, steps_lost=steps_lost, node_local=tuple(node_local), adopt_prebuilt=adopt,
        adoptions=tuple(sorted(adoptions, key=lambda x: (x.owner, x.worker_id))))


def _initial_restart(facts: PlanningFacts) -> tuple[int, tuple[int, ...]] | None:
    """R0: ``(v0, ranks starting fresh)`` when nothing was ever committed or mirrored, else None."""
    if any(r.committed is not None or r.replicas for r in facts.reports):
        return None
    locals_ = [r.local_versions for r in facts.reports if r.local_versions]
    if not locals_:
        if facts.last_resume is not None and facts.last_resume > 0:
            return None  # the job had resumed at a later version: a fresh start would lose it silently
        return 0, tuple(range(facts.world_size))
    v0 = min(min(v) for v in locals_)
    holders = {r.worker_id for r in facts.reports if v0 in r.local_versions}
    if any(r.local_versions and v0 not in r.local_versions for r in facts.reports):
        return None  # a survivor no longer holds the initial capture: nothing consistent to restart from
    fresh = tuple(s.rank for s in facts.members if not (s.alive and s.worker.worker_id in holders))
    return v0, fresh


def _rollbacks_to(facts: PlanningFacts, version: int) -> tuple[Rollback, ...]:
    out = []
    for slot in facts.members:
        rep = facts.report_of(slot.worker.worker_id) if slot.alive else None
        if rep is not None and version in rep.local_versions and rep.newest_captured is not None \
                and rep.newest_captured > version:
            out.append(Rollback(slot.rank, rep.worker_id, rep.newest_captured, version))
    return tuple(out)


def _owners_below_k(facts: PlanningFacts) -> tuple[int, ...]:
    """Owners whose placed holders include a lost rank: their mirrors need re-placing
    (a lost owner's holders also need its *new* worker's image, hence included)."""
    lost = set(facts.lost_ranks)
    return tuple(sorted(o for o, hs in facts.placement.items() if lost & set(hs) or o in lost))


def _ranks_without_replica(facts: PlanningFacts, assignments: list[Assignment] | None = None) -> tuple[int, ...]:
    """Explain a missing common version (R7).

    C = versions every rank with a local image can provide. Listed: ranks
    needing an image (no local copy) whose available versions miss C entirely;
    if there are none (the sets merely fail to overlap jointly, or C is empty),
    every rank needing an image is listed.
    """
    avail = available_versions(facts, assignments)
    cap = trusted_ceiling(facts)
    if cap is not None:
        avail = {r: frozenset(v for v in vs if v <= cap) for r, vs in avail.items()}
    local: dict[int, frozenset[int]] = {}
    for slot in facts.members:
        rep = facts.report_of(slot.worker.worker_id) if slot.alive else None
        local[slot.rank] = rep.local_versions if rep is not None else frozenset()
    needing = [r for r in range(facts.world_size) if not local[r]]
    with_local = [avail[r] for r in range(facts.world_size) if local[r]]
    common = frozenset.intersection(*with_local) if with_local else None
    if common:
        strict = tuple(r for r in needing if not (avail[r] & common))
        if strict:
            return strict
    return tuple(needing)
