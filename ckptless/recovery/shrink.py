"""Going on with fewer ranks: which survivor hosts which lost rank (pure, issue 22).

Why: with no spare and no node to respawn on, a job may wait for the scheduler
(``--replacement-timeout``) or, opted in with ``--lost-node shrink``, go on at
once with the processes it has. The world stays W *logical* ranks: each lost
rank is *hosted* by a survivor, which runs that rank's micro-batch of every
step besides its own (its RNG and data shard, the gradients accumulated before
DDP's one reduction: :mod:`ckptless.worker.hosted`), so the global batch and
the training trajectory are the full world's, up to floating-point reduction
order.

The rules (R10 in docs/recovery.md):

* only when the job's policy says ``shrink``, some lost rank has no spare and
  no node to respawn on (then *every* lost rank is hosted: a generation with
  fewer ranks runs on the survivors alone), and every survivor reported that
  its state can host (a DDP job: ``WorkerReport.can_host``);
* only while at least ``min_nodes`` nodes run ranks (``--nnodes MIN:MAX``);
* only when every survivor holds its own state of the resume version R (a
  transfer could not run over the survivors' communicators) and R >= 2 (DDP
  rebuilds its buckets in its second step, with a broadcast from rank 0);
* a lost rank is hosted by a survivor that *holds* its image of the resume
  version: the host reads the rank's own state (RNG, data position) from the
  copy it already has, so shrinking moves no bytes;
* among those holders, the one hosting fewest ranks so far, then the lowest
  rank: the extra compute spreads evenly and the choice is deterministic.

Cost: O(lost x holders) with the facts' indexes; the plan adds one assignment
per hosted rank (the roster's explicit entries, docs/scale.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptless.recovery.decision import Assignment
from ckptless.recovery.facts import PlanningFacts

__all__ = ["MIN_VERSION", "host_lost_ranks"]

MIN_VERSION = 2  # DDP rebuilds its buckets once, in its second step, with a broadcast from rank 0


def host_lost_ranks(facts: PlanningFacts, unassigned: Sequence[int], version: int) -> tuple[list[Assignment], str]:
    """One ``hosted`` assignment per rank of ``unassigned``, or ``([], why not)``."""
    policy = facts.policy
    if policy.lost_node != "shrink":
        return [], "the job waits for a replacement (--lost-node wait)"
    live = [s for s in facts.members if s.alive]
    nodes = {s.worker.node_id for s in live}
    if len(nodes) < policy.min_nodes:
        return [], (f"fewer ranks needs at least {policy.min_nodes} nodes (--nnodes minimum), "
                    f"{len(nodes)} run ranks")
    reports = {s.rank: facts.report_of(s.worker.worker_id) for s in live}
    cannot = sorted(r for r, rep in reports.items() if rep is None or not rep.can_host)
    if cannot:
        return [], f"ranks {cannot} reported state that cannot run another rank's micro-batches (not a DDP job)"
    lacking = sorted(r for r, rep in reports.items() if rep is not None and version not in rep.local_versions)
    if lacking:  # a transfer would run over the survivors' communicators, which have no rank for it
        return [], f"survivors {lacking} do not hold version {version} of their own state"
    if version < MIN_VERSION:
        return [], (f"version {version} is before DDP rebuilt its buckets (its second step broadcasts the order "
                    "from rank 0: survivors hosting different numbers of ranks would not meet there)")
    holders: dict[int, list[int]] = {}
    for rank, rep in reports.items():
        assert rep is not None
        for f in rep.replicas:
            if f.version == version:
                holders.setdefault(f.owner, []).append(rank)
    load = {s.rank: 0 for s in live}
    slot_of = {s.rank: s for s in live}
    out: list[Assignment] = []
    for rank in sorted(unassigned):
        candidates = holders.get(rank, [])
        if not candidates:
            return [], f"no survivor holds rank {rank}'s image of version {version} to host it from"
        host = min(candidates, key=lambda h: (load[h], h))
        load[host] += 1
        w = slot_of[host].worker
        out.append(Assignment(rank, w.worker_id, w.node_id, "hosted"))
    return out, ""
