"""Agreement over a mirror group without a whole-world collective: a tree reduction, and the
owner <-> holder digest exchange of a partial round.

Why not ``all_reduce``: on a Gloo group it connects every pair of ranks and
takes O(W) hops (ring); the mirror group is formed lazily and connects only
the pairs it uses (``worker/groups.py``), so everything here talks only to a
rank's tree neighbours (:mod:`ckptless.mirror.tree`) or its placement peers.

Costs per call, per rank: :func:`tree_allreduce` sends at most FANOUT + 1
messages of ``8 * len(values)`` bytes and waits ``2 * depth(W)`` hops;
:func:`digest_exchange` sends 2K messages of 8 bytes and waits one hop.

Every wait has the caller's deadline (:class:`TransportError` on expiry: the
caller must treat the group as dead, Gloo keeps the operation running).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from ckptless.mirror import tree
from ckptless.mirror.transport import Deadline, wait_all

# Point-to-point tags of the agreement messages, far above the data tags (transport: 1, 2, 16 + i;
# recovery transfers: (t << 12) | slot): a tag is matched per peer, in order.
TAG_UP, TAG_DOWN, TAG_TO_HOLDER, TAG_TO_OWNER, TAG_HELLO = (0x7FF00000 + i for i in range(5))

Op = Literal["min", "max"]


def _combine(a: torch.Tensor, b: torch.Tensor, op: Op) -> torch.Tensor:
    return torch.minimum(a, b) if op == "min" else torch.maximum(a, b)


def tree_allreduce(group: dist.ProcessGroup, rank: int, world_size: int, values: Sequence[int], op: Op,
                   deadline: Deadline, what: str) -> list[int]:
    """Element-wise MIN or MAX of ``values`` over every rank of ``group``, known to every rank.

    Collective: every rank calls it with the same length, in the same order of calls."""
    mine = torch.tensor(list(values), dtype=torch.int64)
    kids = tree.children(rank, world_size)
    bufs = [torch.empty_like(mine) for _ in kids]
    wait_all([group.recv([b], c, TAG_UP) for b, c in zip(bufs, kids)], deadline, f"{what}: children's values")
    for b in bufs:
        mine = _combine(mine, b, op)
    up = tree.parent(rank)
    if up is not None:
        send = group.send([mine], up, TAG_UP)
        result = torch.empty_like(mine)
        wait_all([send, group.recv([result], up, TAG_DOWN)], deadline, f"{what}: the reduced value")
        mine = result
    wait_all([group.send([mine], c, TAG_DOWN) for c in kids], deadline, f"{what}: passing the value down")
    return [int(x) for x in mine.tolist()]


def digest_exchange(group: dist.ProcessGroup, own: int, holders: Sequence[int], held: Mapping[int, int],
                    deadline: Deadline) -> tuple[dict[int, int], dict[int, int]]:
    """Swap image fingerprints with the placement peers: this rank's own digest goes to each of its
    ``holders``, its digest of each owner's image it holds (``held[owner]``, 0 for none) goes to that
    owner. Returns ``(holder -> its digest of my image, owner -> the owner's own digest)``.

    Both ends of a pair then know the same two numbers, so they decide alike whether it moves bytes."""
    own_t = torch.tensor([own], dtype=torch.int64)
    from_holders = {h: torch.zeros(1, dtype=torch.int64) for h in holders}
    from_owners = {o: torch.zeros(1, dtype=torch.int64) for o in held}
    works = [group.recv([t], h, TAG_TO_OWNER) for h, t in from_holders.items()]
    works += [group.recv([t], o, TAG_TO_HOLDER) for o, t in from_owners.items()]
    outgoing = [torch.tensor([d], dtype=torch.int64) for d in held.values()]
    works += [group.send([own_t], h, TAG_TO_HOLDER) for h in holders]
    works += [group.send([t], o, TAG_TO_OWNER) for o, t in zip(held, outgoing)]
    wait_all(works, deadline, "holdings exchange with the placement peers")
    return ({h: int(t.item()) for h, t in from_holders.items()}, {o: int(t.item()) for o, t in from_owners.items()})


def connect(group: dist.ProcessGroup, peers: Sequence[int], deadline: Deadline) -> None:
    """Exchange one message with every peer, so that a lazily connected group opens exactly these
    connections now (while the generation forms, where they are recorded and abortable)
    rather than inside a later round. ``peers`` must be symmetric: if i names j, j names i."""
    out = torch.zeros(1, dtype=torch.int64)
    ins = [torch.zeros(1, dtype=torch.int64) for _ in peers]
    works = [group.recv([t], p, TAG_HELLO) for t, p in zip(ins, peers)]
    works += [group.send([out], p, TAG_HELLO) for p in peers]
    wait_all(works, deadline, f"connecting to {len(peers)} mirror peers")


__all__ = ["TAG_DOWN", "TAG_HELLO", "TAG_TO_HOLDER", "TAG_TO_OWNER", "TAG_UP", "connect", "digest_exchange",
           "tree_allreduce"]
