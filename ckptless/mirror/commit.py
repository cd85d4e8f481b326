"""Commit protocol: when is version v safe to roll back to (pure decisions).

Definition (DESIGN.md invariant): version v is *committed* when every rank's
image of v is held by the rank itself and by all K of its holders.

How ranks learn it without an etcd write per step: mirror rounds are
collective and in lock-step (every rank submits the same versions in the same
order). At the end of round v each rank contributes ``ack = v`` if its own
image of v is kept locally and every image of v it receives as a holder
verified, else ``-1``; one MIN reduction over the mirror group's agreement
tree (:func:`ckptless.mirror.agreement.tree_allreduce`, ``2 log_4 W`` hops) of
``[ack, v, -v]`` yields ``[min ack, min v, -max v]``. If ``min ack == v`` every
(owner, holder) pair acknowledged v, which is exactly the definition above; if
``min v != max v`` the ranks are out of step (a bug or a stale peer) and the
engine stops. The general function :func:`committed_version` (used by recovery
on reported facts) and the per-round rule agree; tests/e2e/test_mirror_transport.py
checks that with hypothesis.

Why holders must *pin* the committed version: a later round may fail, and the
slot holding the committed image must not be the one overwritten meanwhile
(see :meth:`ckptless.mirror.store.PeerStore.pin`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ckptless.mirror.placement import Placement

NO_ACK = -1


def committed_version(placement: Placement, held: Mapping[int, Collection[tuple[int, int]]]) -> int | None:
    """Newest version complete everywhere, from reported facts.

    ``held[r]`` is the set of ``(owner, version)`` images rank r holds intact
    (its own images appear as ``(r, v)``). Returns None if no version is
    complete on every owner and all its holders.
    """
    common: set[int] | None = None
    for owner in range(placement.world_size):
        need = (owner,) + placement.holders(owner)
        per = [{v for (o, v) in held.get(r, ()) if o == owner} for r in need]
        full = set.intersection(*per)
        common = full if common is None else common & full
        if not common:
            return None
    return max(common) if common else None


def round_ack(version: int, own_kept: bool, received_ok: Mapping[int, bool]) -> int:
    """This rank's contribution to round ``version``'s MIN reduction."""
    return version if own_kept and all(received_ok.values()) else NO_ACK


def encode(ack: int, version: int, diverged: bool = False) -> list[int]:
    """Vector reduced with MIN: [ack, version, -version, -1 if this rank's replicas diverged else 0]
    (the last: every rank learns that some replica set must gather its evidence, replica_check.py)."""
    return [ack, version, -version, -1 if diverged else 0]


@dataclass(frozen=True)
class RoundOutcome:
    committed: int | None  # committed version after this round
    advanced: bool  # this round's version became committed
    in_step: bool  # all ranks mirrored the same version
    diverged: bool = False  # some rank found its replicas' prefixes differ (replica_check.py)


def decide(reduced: Sequence[int], previous: int | None) -> RoundOutcome:
    """Interpret ``MIN([ack, v, -v(, diverged)])`` over all ranks given the previous committed version."""
    min_ack, min_v, neg_max_v = reduced[:3]
    diverged = len(reduced) > 3 and reduced[3] < 0
    in_step = min_v == -neg_max_v
    if in_step and min_ack == min_v and min_ack != NO_ACK and (previous is None or min_ack > previous):
        return RoundOutcome(min_ack, True, True, diverged)
    return RoundOutcome(previous, False, in_step, diverged)
