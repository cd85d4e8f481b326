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
from collections.abc import Callable, Iterable
from typing import Literal, Union

from ckptless.errors import MirrorError
from ckptless.mirror.placement import Placement
from ckptless.state.manifest import Manifest

Pair = tuple[int, int]  # (owner, holder)
#: ``submit(..., pairs=MISSING)``: the engine finds the pairs itself (one small all_reduce).
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


def holdings_row(own: Manifest, held: Iterable[Manifest | None], width: int) -> list[int]:
    """This rank's row of the :data:`MISSING` exchange: own image, then each owner it holds (placement order)."""
    row = [digest(own)] + [digest(m) for m in held]
    if len(row) > width:
        raise MirrorError(f"holdings row of {len(row)} entries exceeds the width {width}")
    return row + [0] * (width - len(row))


def missing_from_rows(placement: Placement, version: int, rows: list[list[int]]) -> frozenset[Pair]:
    """Pairs to send, from every rank's :func:`holdings_row` (identical input on every rank)."""
    def has(holder: int, owner: int, _v: int) -> bool:
        col = 1 + placement.owners_held_by(holder).index(owner)
        return rows[holder][col] != 0 and rows[holder][col] == rows[owner][0]
    return pairs_to_send(placement, version, has)


__all__ = ["MISSING", "Pair", "PairSpec", "check_pairs", "digest", "holdings_row", "missing_from_rows",
           "pairs_to_send", "placement_pairs", "same_image", "split"]
