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
  no node to respawn on (then no lost rank takes a spare or a transfer: a
  generation with fewer ranks runs on the survivors and the respawns below),
  and every survivor reported that its state can host (a DDP job:
  ``WorkerReport.can_host``);
* only while at least ``min_nodes`` nodes run ranks (``--nnodes MIN:MAX``);
* only when every survivor holds its own state of the resume version R (a
  transfer could not run over the survivors' communicators) and R >= 2 (DDP
  rebuilds its buckets in its second step, with a broadcast from rank 0);
* a lost rank whose node lives and kept its own image of the resume version
  (R9) restarts there from it (a respawn moves no bytes either), and is a
  process of the generation like a survivor (issue 35: a host killed while
  the job ran with fewer ranks comes back on its node);
* every other lost rank is hosted by a process that *holds* its image of the
  resume version: the host reads the rank's own state (RNG, data position)
  from the copy it already has, so shrinking moves no bytes. A copy in live
  memory first; else one its node kept (R11, :mod:`ckptless.recovery.nodecopies`:
  a dead host's copy of the rank it hosted, or the rank's own image), which a
  process on that node adopts;
* among those holders, the one hosting fewest ranks so far, then the lowest
  rank; then a rank moves to another of its holders while that one hosts two
  fewer: no holder of a rank hosts 2 fewer than the rank's host, so the extra
  compute spreads evenly, and the choice is deterministic.

Cost: O(lost x holders + node copies) with the facts' indexes; the plan adds
one assignment per hosted rank (the roster's explicit entries, docs/scale.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptless.recovery import nodecopies
from ckptless.recovery.decision import Adoption, Assignment
from ckptless.recovery.facts import NodeLocalImage, PlanningFacts

__all__ = ["MIN_VERSION", "host_lost_ranks"]

MIN_VERSION = 2  # DDP rebuilds its buckets once, in its second step, with a broadcast from rank 0


def host_lost_ranks(facts: PlanningFacts, assignments: Sequence[Assignment], version: int,
                    local: Mapping[int, NodeLocalImage]) -> tuple[list[Assignment], list[Adoption], str]:
    """The generation's assignments with every lost rank hosted or restarted from its node's copy, and
    the adoptions its hosts need; or ``([], [], why not)``.

    ``assignments``: R2's (a lost rank's ``respawn`` there stays a process when ``local``, R9, holds its
    image of ``version`` on its node: it moves no bytes either); ``local``: R9's usable node-local images.
    """
    policy = facts.policy
    if policy.lost_node != "shrink":
        return [], [], "the job waits for a replacement (--lost-node wait)"
    live = [s for s in facts.members if s.alive]
    kept = [a for a in assignments if a.source == "respawn" and a.rank in local and local[a.rank].version == version]
    nodes = {s.worker.node_id for s in live} | {a.node_id for a in kept}
    if len(nodes) < policy.min_nodes:
        return [], [], (f"fewer ranks needs at least {policy.min_nodes} nodes (--nnodes minimum), "
                        f"{len(nodes)} run ranks")
    reports = {s.rank: facts.report_of(s.worker.worker_id) for s in live}
    cannot = sorted(r for r, rep in reports.items() if rep is None or not rep.can_host)
    if cannot:
        return [], [], f"ranks {cannot} reported state that cannot run another rank's micro-batches (not a DDP job)"
    lacking = sorted(r for r, rep in reports.items() if rep is not None and version not in rep.local_versions)
    if lacking:  # a transfer would run over the survivors' communicators, which have no rank for it
        return [], [], f"survivors {lacking} do not hold version {version} of their own state"
    if version < MIN_VERSION:
        return [], [], (f"version {version} is before DDP rebuilt its buckets (its second step broadcasts the "
                        "order from rank 0: survivors hosting different numbers of ranks would not meet there)")
    holders: dict[int, list[int]] = {}
    for rank, rep in reports.items():
        assert rep is not None
        for f in rep.replicas:
            if f.version == version:
                holders.setdefault(f.owner, []).append(rank)
    processes = [Assignment(s.rank, s.worker.worker_id, s.worker.node_id, "survivor") for s in live] + kept
    load = {a.worker_id: 0 for a in processes}
    slot_of = {a.rank: a for a in processes}
    chooser = nodecopies.Chooser(facts, processes, dict(local))
    hosts: dict[int, Assignment] = {}
    adopted: list[Adoption] = []
    # Ranks held in memory first: their hosts are fixed by who holds them, a copy on a node can go to
    # any process there, so it then goes where the load is least.
    for rank in sorted(set(facts.lost_ranks) - {a.rank for a in kept}, key=lambda r: (r not in holders, r)):
        in_memory = holders.get(rank, [])
        if in_memory:
            host = slot_of[min(in_memory, key=lambda h: (load[slot_of[h].worker_id], h))]
            load[host.worker_id] += 1
        else:  # R11: a copy its node kept (a dead host's, or the rank's own), adopted by a process there
            picked = chooser.choose(chooser.candidates(rank, version), load)
            if picked is None:
                return [], [], (f"no survivor holds rank {rank}'s image of version {version} to host it from, "
                                "in memory or in its node's memory")
            host = slot_of[picked[1].rank]
            adopted.append(nodecopies.adoption(*picked))
        hosts[rank] = host
    _rebalance(hosts, holders, slot_of, load)
    out = [Assignment(rank, host.worker_id, host.node_id, "hosted") for rank, host in hosts.items()]
    return sorted(processes + out, key=lambda a: a.rank), adopted, ""


def _rebalance(hosts: dict[int, Assignment], holders: Mapping[int, list[int]],
               slot_of: Mapping[int, Assignment], load: dict[str, int]) -> None:
    """Move a rank held in memory to another of its holders while that one hosts 2 fewer ranks.

    Why: the greedy pass above picks the least-loaded holder rank by rank, so an early choice can
    leave a later rank's only holders loaded while a holder of the early rank stays idle (hypothesis
    found a W=13 world where one survivor hosted 2 ranks and another holder of one of them none);
    that survivor then runs three micro-batches a step and sets the pace of the whole job. Each move
    lowers the sum of squared loads, so this ends, and the scan order keeps it deterministic.
    Cost: O(moves x lost x holders), moves bounded by the sum of squared loads (O(lost^2)).
    """
    moved = True
    while moved:
        moved = False
        for rank in sorted(hosts):
            host = hosts[rank]
            for h in sorted(holders.get(rank, ()), key=lambda h: (load[slot_of[h].worker_id], h)):
                other = slot_of[h]
                if load[other.worker_id] + 2 <= load[host.worker_id]:
                    load[host.worker_id] -= 1
                    load[other.worker_id] += 1
                    hosts[rank] = other
                    moved = True
                    break
