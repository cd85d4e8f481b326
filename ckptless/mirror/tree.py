"""The agreement tree of a mirror group: who a rank talks to when every rank must agree (pure).

Why a tree: a round's commit (every pair acknowledged this version) and a
recovery's stripe verdicts need one reduced value known to every rank. A
whole-world all_reduce over Gloo connects every pair (W - 1 sockets per rank)
and, with Gloo's ring, takes 2 (W - 1) hops. A complete ``FANOUT``-ary tree
rooted at rank 0 (rank r's parent is ``(r - 1) // FANOUT``) reduces up and
broadcasts down in ``2 * depth(W)`` hops, ``depth(W) = ceil(log_FANOUT(W))``
roughly, with at most ``FANOUT + 1`` connections per rank, whatever W is.

Why rank order and not node order: the tree must be computed identically by
every rank from the world size alone; placement already gives each rank its
K data peers, and the tree's messages are a few int64s.
"""

from __future__ import annotations

FANOUT = 4


def parent(rank: int, fanout: int = FANOUT) -> int | None:
    """``rank``'s parent in the tree (None for the root, rank 0)."""
    return None if rank == 0 else (rank - 1) // fanout


def children(rank: int, world_size: int, fanout: int = FANOUT) -> tuple[int, ...]:
    """``rank``'s children, ascending (at most ``fanout``)."""
    first = rank * fanout + 1
    return tuple(range(first, min(first + fanout, world_size)))


def neighbours(rank: int, world_size: int, fanout: int = FANOUT) -> tuple[int, ...]:
    """Every rank ``rank`` exchanges agreement messages with: its parent and children."""
    up = parent(rank, fanout)
    return ((up,) if up is not None else ()) + children(rank, world_size, fanout)


def depth(world_size: int, fanout: int = FANOUT) -> int:
    """Hops from the deepest rank to the root (0 for a world of one)."""
    d, last = 0, world_size - 1
    while last > 0:
        last = (last - 1) // fanout
        d += 1
    return d


__all__ = ["FANOUT", "children", "depth", "neighbours", "parent"]
