"""Rebuild a lost rank's image from its surviving holders, in parallel stripes.

Why stripes from all holders: a rebuild of an S-byte image cannot beat
S / (p2p bandwidth); pulling disjoint chunk ranges from every holder at once
uses all their links. Each stripe is verified against the manifest's chunk
checksums on arrival; a corrupt stripe is fetched again from the next
fallback holder (all ranks learn which stripes failed from one MAX reduction, over
the mirror group's agreement tree, so the retry rounds stay collective and
deterministic).

Runs on the new generation's default group, or on the group given (its
mirror group, before the other groups form: see ``worker/actions.py``); every
rank calls :func:`execute_transfers` with the same plan.
"""

from __future__ import annotations

import logging
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ckptless.errors import IntegrityError, RecoveryError
from ckptless.mirror import tree_allreduce
from ckptless.mirror import PeerStore, StoredImage
from ckptless.mirror import Deadline, wait_all, wait_one
from ckptless.recovery.decision import RecoveryPlan, Stripe, Transfer
from ckptless.recovery.wire import Membership
from ckptless.state import host_memory
from ckptless.state import crc_of
from ckptless.state import Manifest
from ckptless.state import held_from

log = logging.getLogger(__name__)


@dataclass
class Received:
    manifest: Manifest
    buffer: torch.Tensor
    bytes_from: dict[int, int]
    from_replicas: int = 0  # bytes of a replicated prefix served by live replicas (the rest: holders)


def _tag(t_idx: int, slot: int) -> int:
    return (t_idx << 12) | slot


def _isend(t: torch.Tensor, dst: int, tag: int, group: dist.ProcessGroup | None) -> dist.Work | None:
    if group is None:
        return dist.isend(t, dst, tag=tag)
    return group.send([t], dst, tag)


def _irecv(t: torch.Tensor, src: int, tag: int, group: dist.ProcessGroup | None) -> dist.Work | None:
    if group is None:
        return dist.irecv(t, src, tag=tag)
    return group.recv([t], src, tag)


def _verdicts_max(bad: torch.Tensor, group: dist.ProcessGroup | None, deadline: Deadline) -> torch.Tensor:
    """Every rank's stripe verdicts, MAX-reduced: over the mirror group's agreement tree (O(log W)
    hops, O(1) connections per rank), or with one all_reduce on the default group."""
    if group is None:
        wait_one(dist.all_reduce(bad, op=dist.ReduceOp.MAX, async_op=True), deadline, "stripe verdicts")
        return bad
    rank, world = group.rank(), group.size()
    return torch.tensor(tree_allreduce(group, rank, world, bad.tolist(), "max", deadline, "stripe verdicts"),
                        dtype=torch.int64)


def _byte_range(m: Manifest | None, s: Stripe, chunk_bytes: int, total: int) -> tuple[int, int]:
    start = s.start * chunk_bytes
    return start, min(s.stop * chunk_bytes, total)


def _stripe_ok(m: Manifest, buf: torch.Tensor, s: Stripe, sums: torch.Tensor | None = None) -> bool:
    """Every chunk of the stripe matches its checksum: the owner's manifest's, or ``sums`` (the serving
    replica's own, for a prefix stripe)."""
    for c in range(s.start, s.stop):
        off = c * m.chunk_bytes
        n = min(m.chunk_bytes, m.total_bytes - off)
        want = m.chunk_checksums[c] if sums is None else int(sums[c - s.start])
        if crc_of(buf, off, n) != want:
            return False
    return True


def execute_transfers(
    plan: RecoveryPlan,
    membership: Membership,
    my_worker_id: str,
    store: PeerStore | None,
    timeout_s: float,
    into: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    own: Sequence[StoredImage] = (),
) -> Received | None:
    """Send my stripes and, if I am a receiver, return my rebuilt (verified) image.

    ``group``: a Gloo group of the new generation with the membership's ranks
    (None: the default group). ``own``: this rank's own images, which serve the
    stripes of a replicated prefix (``Stripe.own``) that a lost replica needs.
    """
    deadline = Deadline(timeout_s)
    rank_of = {a.worker_id: a.rank for a in membership.ranks if a.source != "hosted"}
    me = rank_of[my_worker_id]
    transfers = sorted(plan.transfers, key=lambda t: t.owner)
    received: Received | None = None
    # Manifests first: the source of stripe 0 of each transfer sends it.
    mine_recv: tuple[int, Transfer] | None = None
    sends: list[dist.Work | None] = []
    keep: list[torch.Tensor] = []
    for t_idx, t in enumerate(transfers):
        receiver = rank_of[t.receiver]
        if receiver == me:
            mine_recv = (t_idx, t)
            continue
        sender = _manifest_source(t)
        if sender is not None and rank_of[sender] == me:
            img = _held(store, t)
            raw = torch.frombuffer(bytearray(img.manifest.to_bytes()), dtype=torch.uint8)
            hdr = torch.tensor([raw.numel()], dtype=torch.int64)
            keep += [raw, hdr]
            sends.append(_isend(hdr, receiver, _tag(t_idx, 0), group))
            sends.append(_isend(raw, receiver, _tag(t_idx, 1), group))
    if mine_recv is not None:
        t_idx, t = mine_recv
        first_source = _manifest_source(t)
        if first_source is None:
            raise RecoveryError(f"plan gives rank {t.owner} v{t.version} no holder to send its manifest")
        src0 = rank_of[first_source]
        hdr = torch.empty(1, dtype=torch.int64)
        wait_one(_irecv(hdr, src0, _tag(t_idx, 0), group), deadline, f"manifest size from rank {src0}")
        raw = torch.empty(int(hdr.item()), dtype=torch.uint8)
        wait_one(_irecv(raw, src0, _tag(t_idx, 1), group), deadline, f"manifest from rank {src0}")
        manifest = Manifest.from_bytes(raw.numpy().tobytes())
        if (manifest.owner, manifest.version) != (t.owner, t.version):
            raise RecoveryError(f"holder sent v{manifest.version} of rank {manifest.owner}, plan says v{t.version} of {t.owner}")
        # Page-locked when this process already uses CUDA: the restore's host-to-device copies from it are
        # then asynchronous, and the buffer joins the capture pool afterwards (worker/reuse.py).
        buf = into if into is not None and into.numel() >= manifest.total_bytes else host_memory.empty(manifest.total_bytes)
        received = Received(manifest, buf[: manifest.total_bytes], {})
    # Stripes, with fallback rounds for corrupt ones.
    n_stripes = sum(len(t.stripes) for t in transfers)
    attempt = 0
    pending = {(ti, si) for ti, t in enumerate(transfers) for si in range(len(t.stripes))}
    # The replicated prefix is checked against the serving replica's own checksums, sent with the
    # stripe: replicas agreed on them at every committed version, and at a version that never
    # committed because one rank's prefix diverged (replica_check) the lost rank's own manifest
    # carries that rank's corrupt checksums, which the majority's bytes must not be held to.
    replica_sums: dict[int, torch.Tensor] = {}
    while pending:
        recvs: list[tuple[int, int, dist.Work | None]] = []
        for t_idx, t in enumerate(transfers):
            receiver = rank_of[t.receiver]
            for s_idx, s in enumerate(t.stripes):
                if (t_idx, s_idx) not in pending:
                    continue
                sources = (s.source, *s.fallbacks)
                if attempt >= len(sources):
                    raise IntegrityError(f"stripe {s.start}-{s.stop} of rank {t.owner} v{t.version} corrupt at every holder")
                src = rank_of[sources[attempt]]
                tag = _tag(t_idx, 2 + s_idx)
                sums_tag = _tag(t_idx, 2 + len(t.stripes) + s_idx)
                if src == me:
                    img = _own_copy(own, t) if s.own else _held(store, t)
                    base = 0 if s.own else held_from(img.manifest)  # a holder's copy starts after the prefix
                    a, b = _byte_range(img.manifest, s, img.manifest.chunk_bytes, img.manifest.total_bytes)
                    if s.own:  # a replica's bytes are checked against its own checksums (see below)
                        sums = torch.tensor(img.manifest.chunk_checksums[s.start:s.stop], dtype=torch.int64)
                        keep.append(sums)
                        sends.append(_isend(sums, receiver, sums_tag, group))
                    sends.append(_isend(img.buffer[a - base:b - base], receiver, tag, group))
                elif receiver == me and received is not None:
                    m = received.manifest
                    a, b = _byte_range(m, s, m.chunk_bytes, m.total_bytes)
                    if s.own:
                        replica_sums[s_idx] = torch.empty(s.stop - s.start, dtype=torch.int64)
                        recvs.append((t_idx, s_idx, _irecv(replica_sums[s_idx], src, sums_tag, group)))
                    recvs.append((t_idx, s_idx, _irecv(received.buffer[a:b], src, tag, group)))
                    received.bytes_from[src] = received.bytes_from.get(src, 0) + (b - a)
                    received.from_replicas += (b - a) if s.own else 0
        wait_all([w for _, _, w in recvs], deadline, "stripe receive")
        wait_all(sends, deadline, "stripe send")
        sends = []
        bad = torch.zeros(max(n_stripes, 1), dtype=torch.int64)
        if received is not None and mine_recv is not None:
            t_idx, t = mine_recv
            base = sum(len(x.stripes) for x in transfers[:t_idx])
            for s_idx, s in enumerate(t.stripes):
                if (t_idx, s_idx) in pending and not _stripe_ok(received.manifest, received.buffer, s,
                                                                  replica_sums.get(s_idx) if s.own else None):
                    bad[base + s_idx] = 1
                    log.warning("stripe %d-%d of rank %d from attempt %d failed its checksum", s.start, s.stop, t.owner, attempt)
        bad = _verdicts_max(bad, group, deadline)
        flat = [(ti, si) for ti, t in enumerate(transfers) for si in range(len(t.stripes))]
        pending = {flat[i] for i in range(n_stripes) if int(bad[i]) == 1}
        attempt += 1
    if received is not None and mine_recv is not None and replica_sums:
        merged = list(received.manifest.chunk_checksums)
        for s_idx, got in replica_sums.items():
            stripe = mine_recv[1].stripes[s_idx]
            merged[stripe.start:stripe.stop] = [int(x) for x in got.tolist()]
        received.manifest = dataclasses.replace(received.manifest, chunk_checksums=tuple(merged))
    return received


def _manifest_source(t: Transfer) -> str | None:
    """Who sends the receiver the owner's manifest: the source of the first stripe a holder serves
    (a replica serving a prefix from its own image has its own manifest, not the owner's)."""
    first = next((s.source for s in t.stripes if not s.own), None)
    return first if first is not None else (t.holders[0] if t.holders else None)


def _own_copy(own: Sequence[StoredImage], t: Transfer) -> StoredImage:
    """This rank's own image of ``t.version``, whose replicated prefix equals the owner's."""
    hits = [img for img in own if img.manifest.version == t.version]
    if not hits:
        raise RecoveryError(f"plan says this replica of rank {t.owner} has its own v{t.version}, but it does not")
    return max(hits, key=lambda img: img.manifest.generation)


def _held(store: PeerStore | None, t: Transfer) -> StoredImage:
    img = None if store is None else store.get(t.owner, t.version)
    if img is None:
        raise RecoveryError(f"plan says this holder has v{t.version} of rank {t.owner}, but it does not")
    return img
