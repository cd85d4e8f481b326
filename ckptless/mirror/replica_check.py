"""Replicas checked against each other in every mirror round (issue 21): silent data corruption found.

Why: ranks of a replica set (DDP, a declared ``replicated_over``) must hold the
same replicated prefix bitwise at every version (:mod:`ckptless.state.replication`).
A bit flipped in one rank's parameters (a faulty GPU or DIMM, a kernel bug) or
a wrong declaration breaks that, and nothing else would notice: the job trains
on, or a replacement is later rebuilt from a corrupt replica. ckptless already
checksums every chunk of every image, so the check is almost free: in each round
a rank sends its prefix's chunk checksums to its two ring neighbours in its set
and compares theirs (2 messages of 8 bytes per prefix chunk out, 2 in, one hop:
O(1) messages per rank, O(S / chunk) bytes).

A rank that differs from a neighbour does not acknowledge the round, so the
version is **never committed** (the commit rule already requires every ack).
The finding names the ranks, the tensors (their paths in the protected state)
and the step. What happens then is the job's policy (``MirrorConfig.on_replica_mismatch``):

* ``stop`` (default): every rank that saw it ends the job with one
  :class:`~ckptless.errors.SilentDataCorruption` error (a user-visible stop,
  never respawned into);
* ``replace``: a rank that differs from both neighbours while they agree with
  each other (a local majority of three) is the odd one: it alone leaves as a
  failed device (its agent marks its GPU bad), and is rebuilt from its
  replicas' images at the last committed version, where the set agreed; the
  others go on. With no majority (a set of two, or neighbours that disagree)
  it stops as above.

A rank whose prefix was read from live tensors that moved under the read
(:mod:`ckptless.state.live_prefix`) *abstains*: its checksums prove nothing
about its replicas, so it neither compares nor is compared (it does not
acknowledge the round either). Each pair of neighbours swaps vectors only when
both sent the same size: every pair decides alike from the two sizes it swapped.

Pure decision (:func:`compare`, :func:`tensor_paths`) apart from the one
exchange (:func:`exchange`), which has the round's deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ckptless.errors import SilentDataCorruption
from ckptless.mirror.transport import Deadline, wait_all
from ckptless.state.manifest import Manifest
from ckptless.state.tree import tensor_paths_of
from ckptless.state.replication import Region

log = logging.getLogger(__name__)

# Above the agreement tags (0x7FF00000 + 0..4): a checksum vector to the next rank, and to the previous.
TAG_TO_NEXT, TAG_TO_PREV = 0x7FF00010, 0x7FF00011
ABSTAIN = -1  # the size a rank sends when it has no trustworthy checksums this round


@dataclass(frozen=True)
class Divergence:
    """What one rank found in one round: which neighbour differs in which chunks, and who is odd."""

    version: int
    rank: int
    differs: tuple[tuple[int, tuple[int, ...]], ...]  # (neighbour, chunks where it differs from this rank)
    tensors: tuple[str, ...]  # the protected tensors those chunks hold
    odd: int | None  # the rank a local majority of three calls odd (None: no majority)

    def describe(self) -> str:
        who = ", ".join(f"rank {n} (chunks {list(c[:8])}{'...' if len(c) > 8 else ''})" for n, c in self.differs)
        names = ", ".join(self.tensors[:6]) + (f" and {len(self.tensors) - 6} more" if len(self.tensors) > 6 else "")
        odd = f"; rank {self.odd} is the odd one (its neighbours agree)" if self.odd is not None else \
            "; no majority tells which copy is right"
        return (f"silent data corruption: at step {self.version} rank {self.rank}'s replicated state differs from "
                f"{who} in {names or 'padding'}{odd}")


def compare(rank: int, region: Region, mine: Sequence[int], prev_sums: Sequence[int] | None,
            next_sums: Sequence[int] | None, version: int, manifest: Manifest | None = None) -> Divergence | None:
    """Pure: this rank's verdict from its own and its neighbours' prefix checksums (None: all agree).
    A neighbour's ``None``: it abstained, nothing is known of it."""
    prev, nxt = region.ranks.neighbours(rank)
    differs: list[tuple[int, tuple[int, ...]]] = []
    for who, theirs in ((prev, prev_sums), (nxt, next_sums)):
        if who == rank or theirs is None:
            continue
        bad = tuple(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        if len(mine) != len(theirs):
            bad = bad + tuple(range(min(len(mine), len(theirs)), max(len(mine), len(theirs))))
        if bad and (who, bad) not in differs:
            differs.append((who, bad))
    if not differs:
        return None
    odd: int | None = None
    both = prev_sums is not None and next_sums is not None and prev != nxt
    neighbours_agree = both and list(prev_sums or ()) == list(next_sums or ())
    if neighbours_agree and {n for n, _ in differs} == {prev, nxt}:
        odd = rank  # both neighbours hold the same bytes and this rank does not
    elif len(differs) == 1 and both:
        odd = differs[0][0]  # one neighbour differs from this rank, the other agrees with it
    chunks = sorted({c for _, cs in differs for c in cs})
    names = tuple(tensor_paths(manifest, chunks)) if manifest is not None else ()
    return Divergence(version, rank, tuple(differs), names, odd)


def tensor_paths(manifest: Manifest, chunks: Sequence[int]) -> list[str]:
    """The state paths (``model.0.weight``, ``optimizer.state.3.exp_avg``) of the tensors whose bytes
    lie in ``chunks`` of the image, in tensor order."""
    spans = [(c * manifest.chunk_bytes, (c + 1) * manifest.chunk_bytes) for c in chunks]
    hit = {i for i, e in enumerate(manifest.tensors)
           if any(e.offset < b and e.offset + e.nbytes > a for a, b in spans)}
    found = tensor_paths_of(manifest.tree)
    return [found.get(i, f"tensor #{i}") for i in sorted(hit)]


def exchange(group: dist.ProcessGroup, rank: int, region: Region, mine: Sequence[int],
             deadline: Deadline, abstain: bool = False) -> tuple[list[int] | None, list[int] | None]:
    """Send ``mine`` to both ring neighbours, receive theirs: (previous rank's, next rank's); None for a
    neighbour that abstained (or when this rank does, ``abstain``).

    Collective within the replica set: every member calls it in the same round."""
    prev, nxt = region.ranks.neighbours(rank)
    mine_n = ABSTAIN if abstain else len(mine)
    # Sizes first: replicas whose prefixes differ in size (a wrong declaration) must not post receives of
    # the wrong size. Each pair then swaps vectors only if both sent the same size, which both ends know.
    size_prev, size_next = torch.empty(1, dtype=torch.int64), torch.empty(1, dtype=torch.int64)
    out = torch.tensor([mine_n], dtype=torch.int64)
    wait_all([group.recv([size_prev], prev, TAG_TO_NEXT), group.recv([size_next], nxt, TAG_TO_PREV),
              group.send([out], nxt, TAG_TO_NEXT), group.send([out], prev, TAG_TO_PREV)],
             deadline, f"the replica check (sizes) with ranks {prev} and {nxt}")
    n_prev, n_next = int(size_prev), int(size_next)
    vec = torch.tensor(list(mine), dtype=torch.int64)
    from_prev, from_next = torch.empty(max(n_prev, 0), dtype=torch.int64), torch.empty(max(n_next, 0), dtype=torch.int64)
    works = []
    if n_prev == mine_n != ABSTAIN:
        works += [group.recv([from_prev], prev, TAG_TO_NEXT), group.send([vec], prev, TAG_TO_PREV)]
    if n_next == mine_n != ABSTAIN:
        works += [group.recv([from_next], nxt, TAG_TO_PREV), group.send([vec], nxt, TAG_TO_NEXT)]
    wait_all(works, deadline, f"the replica check (checksums) with ranks {prev} and {nxt}")

    def theirs(n: int, got: torch.Tensor) -> list[int] | None:
        if abstain or n == ABSTAIN:
            return None
        return [int(x) for x in got.tolist()] if n == mine_n else [-1] * n  # another size: all differ

    return theirs(n_prev, from_prev), theirs(n_next, from_next)


def check(group: dist.ProcessGroup, rank: int, manifest: Manifest, deadline: Deadline,
          abstain: bool = False) -> Divergence | None:
    """One round's check for this rank's image (None when it has no replicated prefix, all agree, or this
    rank ``abstain`` s: its prefix checksums are not trustworthy this round)."""
    from ckptless.state.replication import prefix_chunks, region_of

    region = region_of(manifest)
    n = prefix_chunks(manifest)
    if region is None or n == 0 or rank not in region.ranks:
        return None
    mine = list(manifest.chunk_checksums[:n])
    prev_sums, next_sums = exchange(group, rank, region, mine, deadline, abstain)
    if abstain:
        return None
    return compare(rank, region, mine, prev_sums, next_sums, manifest.version, manifest)


def verdict(d: Divergence, policy: str) -> SilentDataCorruption | None:
    """The engine's error for a divergence it found (None: go on, another rank leaves).

    ``stop``: every rank that saw it stops the job. ``replace``: the odd rank alone leaves (as a failed
    device); its neighbours go on; with no majority every rank that saw it stops."""
    if policy == "replace" and d.odd is not None:
        if d.odd != d.rank:
            return None
        return SilentDataCorruption(d.describe() + ": this rank leaves to be rebuilt from its replicas",
                                    replace=True)
    return SilentDataCorruption(d.describe() + " (policy: stop; --on-replica-mismatch replace rebuilds an odd rank)")


def settle(d: Divergence, policy: str, current: BaseException | None) -> tuple[BaseException | None, bool]:
    """What the engine does with a divergence it found in a round: its error from now on (the
    :func:`verdict`, else ``current``) and whether this rank's own image of that version may still be
    a restore source (not where this rank may hold the bad copy: the odd one, or any rank that saw a
    divergence with no majority). Logs the finding once."""
    log.error("%s", d.describe())
    keep = d.odd is not None and d.odd != d.rank
    return verdict(d, policy) or current, keep
