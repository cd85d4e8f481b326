"""Partial rounds: which (owner, holder) pairs must move bytes, and what a kept pair must prove.

Why: after a recovery at version R most holders still keep the image of R they
received in the previous generation (the replicas the plan restored from). A
full round would re-send all of them: world x K x S bytes competing with the
first steps after recovery. Only the pairs whose holder lacks R carry a payload;
every other pair is *kept*: the holder acknowledges the image it already holds.

The commit rule does not change: R is committed only when every pair of the
placement holds R. A kept pair proves it the cheap way: the owner still sends
its header and manifest (a few KiB) and the holder compares that manifest with
the one of the image its :class:`~ckptless.mirror.store.PeerStore` holds for R
(:func:`same_image`: everything but the generation, so chunk checksums
included). The held image's payload is *not* re-read: the store's cached
verdict is trusted (set when it landed, or when the worker re-verified every
replica for its recovery report a moment ago) unless its /dev/shm file changed
since, in which case it is checksummed again (``PeerStore.verified_copy``).

Pure helpers here; the wire side is in :mod:`ckptless.mirror.transport`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Literal, Union

from ckptless.errors import MirrorError
from ckptless.mirror.placement import Placement
from ckptless.state import Manifest

Pair = tuple[int, int]  # (owner, holder)
#: ``submit(..., pairs=MISSING)``: the engine finds the pairs itself (each pair compares fingerprints).
MISSING: Literal["missing"] = "missing"
PairSpec = Union[frozenset[Pair], Literal["missing"], None]


def placement_pairs(placement: Placement) -> frozenset[Pair]:
    """Every (owner, holder) pair of the placement: what a full round moves."""
    return frozenset((o, h) for o in range(placement.world_size) for h in placement.holders(o))


def pairs_to_send(placement: Placement, version: int, has: Callable[[int, int, int], bool]) -> frozenset[Pair]:
    """The pairs whose holder lacks ``version`` of the owner's image: ``has(holder, owner, version)``.

    Pure. Every rank evaluates it on the same facts (the recovery plan, or the
    gathered holdings of :data:`MISSING`) and so passes the same set to
    :meth:`MirrorEngine.submit`.
    """
    return frozenset((o, h) for o in range(placement.world_size) for h in placement.holders(o)
                     if not has(h, o, version))


def check_pairs(placement: Placement, pairs: Iterable[Pair]) -> frozenset[Pair]:
    """``pairs`` as a frozenset; raises :class:`MirrorError` for a pair outside the placement."""
    out = frozenset((int(o), int(h)) for o, h in pairs)
    stray = sorted(out - placement_pairs(placement))
    if stray:
        raise MirrorError(f"pairs {stray[:8]} are not (owner, holder) pairs of the placement")
    return out


def split(pairs: frozenset[Pair] | None, rank: int, placement: Placement) -> tuple[frozenset[int], frozenset[int]]:
    """(holders this rank sends its payload to, owners whose payload it receives); None = all."""
    if pairs is None:
        return frozenset(placement.holders(rank)), frozenset(placement.owners_held_by(rank))
    return (frozenset(h for o, h in pairs if o == rank), frozenset(o for o, h in pairs if h == rank))


def same_image(held: Manifest, offered: Manifest) -> bool:
    """True when ``held`` describes the very image ``offered`` does (any generation)."""
    return dataclasses.replace(held, generation=offered.generation) == offered


def digest(m: Manifest | None) -> int:
    """63-bit fingerprint of an image independent of its generation; 0 for no image."""
    if m is None:
        return 0
    raw = dataclasses.replace(m, generation=0).to_bytes()
    return (int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1) | 1


def my_missing_pairs(rank: int, own: int, holder_digests: Mapping[int, int], held: Mapping[int, int],
                     owner_digests: Mapping[int, int]) -> frozenset[Pair]:
    """:data:`MISSING` for the pairs ``rank`` is in, from fingerprints (:func:`digest`) swapped
    along those pairs only: ``own`` is its image's, ``holder_digests[h]`` its holder h's copy of it,
    ``held[o]`` its copy of owner o's image, ``owner_digests[o]`` o's own. A pair moves bytes when the
    holder has no copy (0) or another image; both ends read the same two numbers, so they agree, and
    the union over all ranks is :func:`pairs_to_send` over the same holdings."""
    mine = {(rank, h) for h, d in holder_digests.items() if d == 0 or d != own}
    mine |= {(o, rank) for o, d in owner_digests.items() if held[o] == 0 or held[o] != d}
    return frozenset(mine)


__all__ = ["MISSING", "Pair", "PairSpec", "check_pairs", "digest", "my_missing_pairs", "pairs_to_send", "placement_pairs", "same_image", "split"]
