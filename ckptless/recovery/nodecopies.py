"""R11: copies in the node-local tier of a live node, taken over by a live worker there (pure).

Why: a worker's node-local tier (``--shm-dir``) outlives the worker: its own
committed image (:mod:`ckptless.mirror.ownimage`) and every replica it held
(:mod:`ckptless.mirror.slot_files`) stay in that node's memory after a
SIGKILL, and its agent reports them, verified, in the exit record. Before
issue 35 only a respawn of the same rank on that node could use its own
image (R9), and the replicas counted as gone: a host lost while the job ran
with fewer ranks took the only copy of the rank it hosted with it, and two
overlapping losses (a rank, then its holder's node) ended ``unrecoverable``
while the copy sat on a live node. Any process on the node can map those
files, so any worker of the new generation there can hold such a copy:

* a copy is *adoptable* at version v when a worker of the new generation
  runs on its node and holds v of its own state when the adoptions run: a
  survivor with v in memory, or a respawn restoring v from its node's copy
  (R9; it adopts after that restore and before any transfer);
* it counts for R3 like a replica held by that worker (a copy without its
  replicated prefix, like any such replica, only when a live replica holds
  the prefix);
* R6/R10 use one only for an image no live process holds at R: the adopter is
  then the holder the plan stripes from, or the host that runs the rank's
  micro-batches (fewer ranks), chosen among the candidates as the one with
  the fewest adoptions so far, then the lowest rank: deterministic, spread.

Trust: the facts name only copies whose files no later process of the same
rank can have touched (:func:`ckptless.recovery.gather.node_copies`), and the
adopter checks every chunk again before it uses one; a copy that fails fails
the restore, which is re-planned.

Cost: one pass over the copies (O(W x K) at most: each dead worker's K
replicas and its own image) and one over the live members to index them by
node, so O(W + copies) per plan; docs/scale.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckptless.recovery.decision import Adoption, Assignment
from ckptless.recovery.facts import NodeLocalCopy, NodeLocalImage, PlanningFacts


@dataclass(frozen=True)
class Adopter:
    """A worker of the new generation that can take copies on its node: what it will hold of its own."""

    rank: int
    worker_id: str
    node_id: str
    versions: frozenset[int]


def adopters(facts: PlanningFacts, assignments: Iterable[Assignment],
             local: dict[int, NodeLocalImage]) -> dict[str, list[Adopter]]:
    """node -> the workers there that may adopt, by rank: survivors (their own versions in memory) and
    respawns restoring their node's copy (R9: that one version). Dead nodes have none."""
    out: dict[str, list[Adopter]] = {}
    for a in assignments:
        if a.node_id in facts.dead_nodes:
            continue
        if a.source == "survivor":
            rep = facts.report_of(a.worker_id)
            versions = rep.local_versions if rep is not None else frozenset()
        elif a.source == "respawn" and a.rank in local:
            versions = frozenset({local[a.rank].version})
        else:
            continue
        if versions:
            out.setdefault(a.node_id, []).append(Adopter(a.rank, a.worker_id, a.node_id, versions))
    for workers in out.values():
        workers.sort(key=lambda w: w.rank)
    return out


def copies_by_image(facts: PlanningFacts,
                    by_node: dict[str, list[Adopter]]) -> dict[tuple[int, int], list[NodeLocalCopy]]:
    """(owner, version) -> its adoptable copies, by (node, holder): some adopter there, other than the
    owner itself (a worker never holds its own rank as a replica), holds the version."""
    out: dict[tuple[int, int], list[NodeLocalCopy]] = {}
    for c in facts.node_copies:
        if any(c.version in w.versions and w.rank != c.owner for w in by_node.get(c.node_id, ())):
            out.setdefault((c.owner, c.version), []).append(c)
    for copies in out.values():
        copies.sort(key=lambda c: (c.node_id, c.holder))
    return out


class Chooser:
    """Picks one adopter per image that needs one, spreading the adoptions (state: the load so far)."""

    def __init__(self, facts: PlanningFacts, assignments: Iterable[Assignment], local: dict[int, NodeLocalImage]):
        self.by_node = adopters(facts, assignments, local)
        self.copies = copies_by_image(facts, self.by_node)
        self.load: dict[str, int] = {}

    def candidates(self, owner: int, version: int) -> list[tuple[NodeLocalCopy, Adopter]]:
        """Every (copy, adopter) that can provide ``owner``'s image at ``version``."""
        out = []
        for c in self.copies.get((owner, version), ()):
            out += [(c, w) for w in self.by_node.get(c.node_id, ()) if version in w.versions and w.rank != owner]
        return out

    def choose(self, among: Iterable[tuple[NodeLocalCopy, Adopter]], load: dict[str, int] | None = None
               ) -> tuple[NodeLocalCopy, Adopter] | None:
        """The candidate whose adopter has the least ``load`` (default: the copies it took so far), then
        the lowest rank, then the first copy; recorded in that load. None when there is none."""
        load = self.load if load is None else load

        def key(item: tuple[NodeLocalCopy, Adopter]) -> tuple[int, int, str, int]:
            c, w = item
            return (load.get(w.worker_id, 0), w.rank, c.node_id, c.holder)
        best = min(among, key=key, default=None)
        if best is not None:
            load[best[1].worker_id] = load.get(best[1].worker_id, 0) + 1
        return best


def adoption(copy: NodeLocalCopy, adopter: Adopter) -> Adoption:
    return Adoption(adopter.worker_id, copy.owner, copy.holder, copy.node_id, copy.version, copy.n_chunks,
                    copy.generation)
