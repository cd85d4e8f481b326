"""Which ranks a rank's mirror group connects to in a generation (pure: membership in, ranks out).

Why: the mirror group is lazy (``groups.mirror_group``) and opens only these
connections, at formation: the K holders of this rank's image and the owners
whose images it holds (the placement the engine will compute from the same
inputs), its agreement-tree neighbours (``mirror/tree.py``), and, in a
recovery, the ranks it exchanges stripes with (a source of one of its stripes,
or the receiver of a stripe it sources or may fall back to). The relation is
symmetric by construction, as :func:`ckptless.mirror.agreement.connect` needs:
i lists j exactly when j lists i.

Cost: O(W * K) time to compute the placement (every rank computes the same one),
O(K + FANOUT + transfer partners) result.
"""

from __future__ import annotations

from ckptless.errors import ConfigError, PlacementError
from ckptless.mirror import tree
from ckptless.mirror import compute_placement
from ckptless.recovery import RecoveryPlan
from ckptless.recovery import Membership


def node_of(m: Membership) -> list[str]:
    """Every rank's node, in rank order (one pass over the membership, not one lookup per rank)."""
    nodes = [""] * m.world_size
    for a in m.ranks:
        nodes[a.rank] = a.node_id
    return nodes


def mirror_peers(m: Membership, rank: int, replicas: int, strategy: str) -> list[int]:
    """The ranks ``rank``'s mirror group of generation ``m`` connects to at formation, ascending."""
    peers: set[int] = set(tree.neighbours(rank, m.world_size))
    if replicas > 0 and m.world_size > 1:
        try:
            placement = compute_placement(m.world_size, replicas, strategy, node_of(m))
        except (ConfigError, PlacementError):
            placement = None  # the engine raises the same error, clearly, when it is made
        if placement is not None:
            peers.update(placement.holders(rank))
            peers.update(placement.owners_held_by(rank))
    if isinstance(m.decision, RecoveryPlan):
        rank_of = {a.worker_id: a.rank for a in m.ranks if a.source != "hosted"}
        for t in m.decision.transfers:
            receiver = rank_of.get(t.receiver)
            if t.holders and all(s.own for s in t.stripes):  # the manifest's sender serves no stripe
                sender = rank_of.get(t.holders[0])
                if receiver == rank and sender is not None:
                    peers.add(sender)
                elif sender == rank and receiver is not None:
                    peers.add(receiver)
            for s in t.stripes:
                senders = {rank_of.get(w) for w in (s.source, *s.fallbacks)} - {None}
                if receiver == rank:
                    peers.update(r for r in senders if r is not None)
                elif rank in senders and receiver is not None:
                    peers.add(receiver)
    peers.discard(rank)
    return sorted(peers)


__all__ = ["mirror_peers", "node_of"]
