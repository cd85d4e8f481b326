"""One mirror round on the wire: send my image to my K holders, receive the
images I hold for others, straight into the peer store's writing slots.

Wire format (per owner -> holder pair, all on the dedicated mirror group):

1. header, int64[9]: ``[MAGIC, job_hash, generation, version, owner,
   manifest_len, total_bytes, chunk_bytes, moves]`` (tag ``TAG_HEADER``);
2. manifest, uint8[manifest_len]: ``Manifest.to_bytes()`` JSON (``TAG_MANIFEST``);
3. payload, only when ``moves == 1``: ``ceil(total_bytes / wire_bytes)`` uint8
   messages, message i covering bytes ``[i*wire_bytes, ...)`` (tag ``TAG_PAYLOAD + i``).

Partial rounds (:mod:`ckptless.mirror.partial`): a pair outside the round's
pair set is *kept*: header and manifest still travel (``moves == 0``), no
payload; the holder acknowledges only if its store holds the same image
(``PeerStore.verified_copy`` + ``partial.same_image``), else the pair is
*missing* and the round cannot commit. ``moves`` also cross-checks that both
sides were given the same pair set (a mismatch is an out-of-step error).

Throttle: with ``rate_bytes_s`` the sender posts one payload message at a
time and sleeps whenever it is ahead of that rate, so a background round's
CPU work (loopback copies, the receivers' CRC) is spread over more of the
training steps instead of landing on the first ones.

Why three phases: the receiver learns sizes from the header, checks job and
generation before accepting anything bigger, then gets the slot from the store
(``begin``) and posts the payload receives directly into it (no staging copy).
Checksums of the chunks a message covers are verified as soon as it lands,
overlapping with the rest of the transfer.

Deadlock freedom: in every phase all receives are posted before all sends and
all are asynchronous (Gloo ``irecv``/``isend``), so no rank waits on a peer
that is itself waiting to send. Every wait has the round's deadline; on expiry
:class:`TransportError` is raised and the caller must consider the group dead
(DESIGN.md: the op keeps running after ``wait(timeout)`` returns).

Device-agnostic: with an NCCL mirror group, header/manifest/payload travel
through device tensors and are copied into the CPU store. That path is written
but was not run here (no GPU, and NCCL cannot pair two ranks on one GPU).
"""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ckptless.errors import ManifestError, MirrorError, StaleGeneration, TransportError
from ckptless.mirror.partial import same_image
from ckptless.mirror.store import PeerStore
from ckptless.state import bad_chunks
from ckptless.state import Manifest
from ckptless.state import held_from

MAGIC = 0x636B70746C657373  # "ckptless"
HEADER_LEN = 9
TAG_HEADER, TAG_MANIFEST, TAG_PAYLOAD = 1, 2, 16
MAX_MANIFEST_BYTES = 256 << 20


def job_hash(job_id: str) -> int:
    """63-bit stable hash of the job id (fits a signed int64)."""
    return int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class Header:
    magic: int
    job: int
    generation: int
    version: int
    owner: int
    manifest_len: int
    total_bytes: int
    chunk_bytes: int
    moves: int = 1  # 1: the payload follows; 0: a kept pair of a partial round

    def to_list(self) -> list[int]:
        return [self.magic, self.job, self.generation, self.version, self.owner,
                self.manifest_len, self.total_bytes, self.chunk_bytes, self.moves]

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Header:
        return cls(*(int(x) for x in t.cpu().tolist()))


class Deadline:
    """Remaining time of one round; every wait takes what is left."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def remaining(self, what: str) -> datetime.timedelta:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransportError(f"mirror round ran past its {self.seconds:.1f}s deadline before {what}")
        return datetime.timedelta(seconds=left)


def wait_all(works: Sequence[dist.Work | None], deadline: Deadline, what: str) -> None:
    for w in works:
        wait_one(w, deadline, what)


def wait_one(work: dist.Work | None, deadline: Deadline, what: str) -> None:
    """Blocking wait bounded by the round's deadline.

    Gloo point-to-point work cannot be polled (``is_completed`` stays False
    until ``wait``) nor waited in slices (a timed-out wait closes the pair), so
    a round waits natively; a thread left inside such a wait by a recovery is
    handled at exit by :mod:`ckptless.worker.exit_guard`.
    """
    if work is None:
        return
    timeout = deadline.remaining(what)
    try:
        ok = work.wait(timeout=timeout)
    except RuntimeError as exc:  # Gloo: timeout, connection closed/reset by peer
        raise TransportError(f"{what} failed: {exc}") from exc
    if ok is False:
        raise TransportError(f"{what} did not complete within {timeout.total_seconds():.1f}s")


@dataclass
class RoundResult:
    """What one rank saw in one round."""

    version: int
    received: dict[int, Manifest] = field(default_factory=dict)  # owner -> verified manifest
    corrupt: dict[int, list[int]] = field(default_factory=dict)  # owner -> bad chunk indices
    kept: list[int] = field(default_factory=list)  # owners acknowledged from the image already held
    missing: list[int] = field(default_factory=list)  # kept pairs whose image this holder lacks
    bytes_sent: int = 0
    bytes_received: int = 0


class MirrorTransport:
    """Runs rounds on ``group``; ``rank`` is this process's rank *in that group*."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        holders: Sequence[int],
        owners: Sequence[int],
        job_id: str,
        generation: int,
        wire_bytes: int,
        rate_bytes_s: float = 0.0,
    ) -> None:
        self.group = group
        self.rank = rank
        self.holders = tuple(holders)
        self.owners = tuple(owners)
        self.job_id = job_id
        self.job = job_hash(job_id)
        self.generation = generation
        self.wire_bytes = wire_bytes
        self.rate_bytes_s = rate_bytes_s
        # Every posted operation and its tensor stay referenced until its round
        # completes: a Gloo op abandoned mid-flight (a round that failed) must
        # never have its Work or buffer freed while Gloo may still touch them.
        self._inflight: list[tuple[dist.Work, torch.Tensor]] = []
        backend = str(group.name()).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    # --- p2p helpers (device-agnostic) -----------------------------------------------------
    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> dist.Work | None:
        # Methods of the ProcessGroup itself: the mirror group is deliberately not
        # registered with c10d (see ckptless/worker/groups.py), so the dist.* helpers
        # that look groups up in c10d's registry cannot be used.
        t = t.to(self.device)
        work = self.group.send([t], dst, tag)
        self._inflight.append((work, t))
        return work

    def _irecv(self, t: torch.Tensor, src: int, tag: int) -> tuple[dist.Work | None, torch.Tensor]:
        """Receive into ``t`` (CPU); on a device group into a staging tensor copied later."""
        land = t if self.device.type == "cpu" else torch.empty_like(t, device=self.device)
        work = self.group.recv([land], src, tag)
        self._inflight.append((work, land))
        return work, land

    @staticmethod
    def _landed(dst: torch.Tensor, land: torch.Tensor) -> None:
        if land.data_ptr() != dst.data_ptr():
            dst.copy_(land)  # device -> CPU; synchronous, so it is complete on return

    def _spans(self, total: int, start: int = 0) -> list[tuple[int, int]]:
        """The payload's messages: ``[start, total)`` (``start``: where holders' copies begin, a whole chunk)."""
        return [(off, min(self.wire_bytes, total - off)) for off in range(start, total, self.wire_bytes)]

    # --- one round -------------------------------------------------------------------------------------
    def exchange(
        self,
        manifest: Manifest,
        buffer: torch.Tensor,
        store: PeerStore,
        deadline: Deadline,
        on_check: Callable[[int, Header], None] | None = None,
        send_to: frozenset[int] | None = None,
        recv_from: frozenset[int] | None = None,
        buffer_base: int = 0,
    ) -> RoundResult:
        """Send ``(manifest, buffer)`` to my holders, receive my owners' images into ``store``.

        ``send_to`` / ``recv_from`` (None: all) restrict the payload to a
        partial round's pairs; the other pairs are kept (module doc). ``buffer_base``:
        ``buffer`` holds the image from that byte on (a deferred prefix, never
        sent: it must not exceed where holders' copies begin).
        """
        if buffer_base > held_from(manifest):
            raise MirrorError(f"rank {self.rank}'s buffer starts at byte {buffer_base}, past what its holders keep")
        if manifest.owner != self.rank or manifest.job_id != self.job_id:
            raise MirrorError(f"rank {self.rank} asked to mirror owner {manifest.owner} of job {manifest.job_id!r}")
        if manifest.generation != self.generation:
            raise StaleGeneration(f"image of generation {manifest.generation}, transport at {self.generation}")
        send_to = frozenset(self.holders) if send_to is None else send_to
        recv_from = frozenset(self.owners) if recv_from is None else recv_from
        res = RoundResult(manifest.version)
        mbytes = torch.frombuffer(bytearray(manifest.to_bytes()), dtype=torch.uint8)
        mine = {h: torch.tensor(Header(MAGIC, self.job, manifest.generation, manifest.version, self.rank,
                                       mbytes.numel(), manifest.total_bytes, manifest.chunk_bytes,
                                       int(h in send_to)).to_list(), dtype=torch.int64)
                for h in self.holders}
        # Phase 1: headers.
        hdr_bufs = {o: torch.empty(HEADER_LEN, dtype=torch.int64) for o in self.owners}
        recvs = {o: self._irecv(hdr_bufs[o], o, TAG_HEADER) for o in self.owners}
        sends = [self._isend(mine[h], h, TAG_HEADER) for h in self.holders]
        headers: dict[int, Header] = {}
        for o, (w, land) in recvs.items():
            wait_one(w, deadline, f"header from rank {o}")
            self._landed(hdr_bufs[o], land)
            headers[o] = hdr = Header.from_tensor(hdr_bufs[o])
            self._check_header(o, hdr, manifest, o in recv_from)
            if on_check is not None:
                on_check(o, hdr)
        wait_all(sends, deadline, "header send")
        # Phase 2: manifests.
        man_bufs = {o: torch.empty(headers[o].manifest_len, dtype=torch.uint8) for o in self.owners}
        mrecvs = {o: self._irecv(man_bufs[o], o, TAG_MANIFEST) for o in self.owners}
        sends = [self._isend(mbytes, h, TAG_MANIFEST) for h in self.holders]
        manifests: dict[int, Manifest] = {}
        for o, (w, land) in mrecvs.items():
            wait_one(w, deadline, f"manifest from rank {o}")
            self._landed(man_bufs[o], land)
            try:
                m = Manifest.from_bytes(bytes(man_bufs[o].numpy()))
            except ManifestError as exc:
                raise TransportError(f"rank {o} sent an invalid manifest") from exc
            self._check_manifest(o, headers[o], m)
            manifests[o] = m
        wait_all(sends, deadline, "manifest send")
        # Kept pairs: the image must already be here, identical and verified.
        for o, m in manifests.items():
            if o not in recv_from:
                held = store.verified_copy(o, m.version)
                if held is not None and same_image(held, m):
                    res.kept.append(o)
                    res.received[o] = held
                else:
                    res.missing.append(o)
        moving = {o: m for o, m in manifests.items() if o in recv_from}
        # Phase 3: payload straight into the store's writing slots.
        views = {o: store.begin(m) for o, m in moving.items()}
        try:
            # Byte b of an owner's image lands at views[o][b - base]: a holder keeps no replicated prefix.
            base = {o: held_from(m) for o, m in moving.items()}
            precvs = {o: [(self._irecv(views[o][off - base[o]:off - base[o] + n], o, TAG_PAYLOAD + i), off, n)
                          for i, (off, n) in enumerate(self._spans(m.total_bytes, base[o]))]
                      for o, m in moving.items()}
            psends = self._send_payload(buffer, manifest.total_bytes, [h for h in self.holders if h in send_to],
                                        res, deadline, held_from(manifest), buffer_base)
            for o, parts in precvs.items():
                m = moving[o]
                bad: list[int] = []
                for (w, land), off, n in parts:
                    wait_one(w, deadline, f"payload from rank {o}")
                    view = views[o][off - base[o]:off - base[o] + n]
                    self._landed(view, land)
                    res.bytes_received += n
                    first = off // m.chunk_bytes
                    sums = list(m.chunk_checksums[first:first + -(-n // m.chunk_bytes)])
                    bad += [first + b for b in bad_chunks(view, m.chunk_bytes, sums, n)]
                if bad:
                    res.corrupt[o] = bad
                    store.abort(o)
                else:
                    store.complete(o, verified=True)
                    res.received[o] = m
            wait_all(psends, deadline, "payload send")
        except BaseException:
            for o in moving:
                store.abort(o)
            raise
        self._inflight.clear()  # the round completed: nothing of it is pending any more
        return res

    def _send_payload(self, buffer: torch.Tensor, total: int, holders: list[int], res: RoundResult,
                      deadline: Deadline, start: int = 0, base: int = 0) -> list[dist.Work | None]:
        """Post the payload messages (bytes ``[start, total)``, byte ``b`` at ``buffer[b - base]``); with a
        rate cap one at a time, sleeping while ahead of it."""
        works: list[dist.Work | None] = []
        t0 = time.monotonic()
        for i, (off, n) in enumerate(self._spans(total, start)):
            for h in holders:
                w = self._isend(buffer[off - base:off - base + n], h, TAG_PAYLOAD + i)
                res.bytes_sent += n
                if self.rate_bytes_s <= 0:
                    works.append(w)
                    continue
                wait_one(w, deadline, f"payload send to rank {h}")
                ahead = t0 + res.bytes_sent / self.rate_bytes_s - time.monotonic()
                if ahead > 0:
                    deadline.remaining("throttled payload send")
                    time.sleep(min(ahead, max(0.0, deadline.end - time.monotonic())))
        return works

    def _check_header(self, src: int, h: Header, mine: Manifest, moves: bool = True) -> None:
        if h.magic != MAGIC:
            raise TransportError(f"rank {src} sent a header with bad magic {h.magic:#x}")
        if h.job != self.job:
            raise StaleGeneration(f"rank {src} mirrors another job (hash {h.job:#x})")
        if h.generation != self.generation:
            raise StaleGeneration(f"rank {src} is at generation {h.generation}, this rank at {self.generation}")
        if h.owner != src:
            raise TransportError(f"rank {src} sent a header for owner {h.owner}")
        if h.version != mine.version:
            raise MirrorError(f"ranks out of step: rank {src} mirrors v{h.version}, this rank v{mine.version}")
        if h.moves != int(moves):
            raise MirrorError(f"ranks out of step: rank {src} {'sends' if h.moves else 'keeps'} its payload, "
                              f"this rank expected the opposite (different pair sets)")
        if not (0 < h.manifest_len <= MAX_MANIFEST_BYTES) or h.total_bytes < 0 or h.chunk_bytes <= 0:
            raise TransportError(f"rank {src} sent implausible sizes {h}")

    def _check_manifest(self, src: int, h: Header, m: Manifest) -> None:
        if (m.job_id != self.job_id or m.owner != src or m.version != h.version or m.generation != h.generation
                or m.total_bytes != h.total_bytes or m.chunk_bytes != h.chunk_bytes):
            raise TransportError(f"rank {src}: manifest does not match its header")
        if self.wire_bytes % m.chunk_bytes:
            raise TransportError(f"rank {src}: chunk_bytes {m.chunk_bytes} does not divide wire_bytes {self.wire_bytes}")
