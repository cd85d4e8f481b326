"""MirrorEngine: the background mirror loop, its owner-side buffer pool and commits.

Why a background thread: the training step must only wait for its local copy
(the capture into a pool buffer); sending to K peers and receiving their
images run on the dedicated mirror group meanwhile.

The owner-side buffer pool (what each capture buffer holds when, and the deferred prefix) is
:mod:`ckptless.mirror.pool`.

Node-local tier (``config.shm_dir`` set and ``config.node_local``): the pool buffers are files in
``shm_dir`` and the committed one carries a manifest file beside it, so a respawn on this node can
restore the committed image after this process died (:mod:`ckptless.mirror.ownimage`). The buffer
states below decide when that manifest is written (on commit, before the older one is removed)
and removed (before its buffer is captured into again).

Rounds are collective: every rank must submit the same versions in the same order (use
``should_mirror(step)``), with the same ``pairs``. A partial round (``pairs``: see
:mod:`ckptless.mirror.partial`) moves the payload only for the given (owner, holder) pairs and
commits only if every other holder already holds the identical image. A round ending with corrupt
or missing replicas, or replicas that differ (:mod:`ckptless.mirror.replica_check`), is not
committed but the engine continues; a transport error, a stale or out-of-step peer marks the
engine broken: ``error`` is set, waiters wake, and every later call raises. Recovery then builds a
new engine on a new group, passing the old ``store`` along.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ckptless.errors import MirrorError, SilentDataCorruption, TransportError
from ckptless.mirror import agreement, buffers, replica_check, replica_verdict
from ckptless.mirror.commit import RoundOutcome, decide, encode, round_ack
from ckptless.mirror.config import MirrorConfig
from ckptless.mirror.partial import MISSING, Pair, PairSpec, check_pairs, digest, my_missing_pairs, split
from ckptless.mirror.ownimage import OwnImageFiles
from ckptless.mirror.placement import Placement, compute_placement
from ckptless.mirror.pool import COMMITTED, FREE, INFLIGHT, QUEUED, OwnerPool, _Buf, _has_checksums
from ckptless.mirror.store import PeerStore
from ckptless.mirror.transport import Deadline, MirrorTransport, RoundResult
from ckptless.state import chunk_checksums
from ckptless.state import CopyFence
from ckptless.state import LivePrefix
from ckptless.state import Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundStats:
    version: int
    committed: int | None
    seconds: float
    bytes_sent: int
    bytes_received: int
    corrupt: dict[int, list[int]]
    pairs: frozenset[Pair] | None = None  # pairs that moved bytes (MISSING: only this rank's); None: full
    kept: tuple[int, ...] = ()  # owners this rank acknowledged from the image it already held
    missing: tuple[int, ...] = ()  # owners whose kept image this rank lacked (round not committed)


class MirrorEngine(OwnerPool):
    """Mirrors this rank's images to its holders and holds its owners' images."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        job_id: str,
        config: MirrorConfig | None = None,
        generation: int = 0,
        node_of: Sequence[Hashable] | None = None,
        placement: Placement | None = None,
        store: PeerStore | None = None,
        on_commit: Callable[[int], None] | None = None,
        background: bool = True,
        strikes: replica_check.StrikeBook | None = None,
    ) -> None:
        self.config = config or MirrorConfig()
        self.rank = group.rank()
        self.world_size = group.size()
        self.config.validate_for_world(self.world_size)
        self.placement = placement or compute_placement(
            self.world_size, self.config.replicas, self.config.placement, node_of)
        self.job_id, self.generation = job_id, generation
        # The replica check's evidence: where each rank runs (read lazily: O(1) here), and the ranks this
        # process saw replaced for corruption (the runtime's book outlives this engine: replica_check.StrikeBook).
        self.layout = replica_check.Layout(node_of, self.world_size)
        self.strikes = strikes if strikes is not None else replica_check.StrikeBook()
        self._last_round: int | None = None  # the version of the newest round that ended
        # Files are keyed by this holder's rank and node: holders sharing a host never share a file.
        node = None if node_of is None else str(node_of[self.rank])
        self.store = store or PeerStore(job_id, generation, self.config.shm_dir, holder=self.rank, node=node)
        # The node-local tier: this rank's capture buffers live in shm_dir and survive its death.
        self.own_files: OwnImageFiles | None = None
        if self.config.shm_dir and self.config.node_local:
            self.own_files = OwnImageFiles(self.config.shm_dir, job_id, node, self.rank)
        self.store.set_generation(generation)
        self.group = group
        self.transport = MirrorTransport(
            group, self.rank, self.placement.holders(self.rank), self.placement.owners_held_by(self.rank),
            job_id, generation, self.config.wire_bytes, self.config.max_send_bytes_s)
        self.on_commit = on_commit
        self.committed_version: int | None = None
        self.error: BaseException | None = None
        self.history: list[RoundStats] = []
        self._pool: list[_Buf] = []
        self._cond = threading.Condition()
        self._queue: queue.Queue[tuple[Manifest, torch.Tensor, PairSpec] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name=f"ckptless-mirror-{self.rank}", daemon=True)
            self._thread.start()

    @property
    def broken(self) -> bool:
        return self.error is not None

    def _raise_if_broken(self) -> None:
        if isinstance(self.error, SilentDataCorruption):  # not a fault: the job's policy (replica_check)
            raise self.error
        if self.error is not None:
            raise MirrorError(f"mirror engine of rank {self.rank} is broken: {self.error}") from self.error

    def should_mirror(self, step: int) -> bool:
        return step % self.config.mirror_every == 0

    # --- submission -------------------------------------------------------------------------
    def submit(self, manifest: Manifest, buffer: torch.Tensor, pairs: PairSpec = None,
               fence: CopyFence | None = None, live: LivePrefix | None = None) -> None:
        """Queue one image for the next round; returns at once (background) or after it.

        ``pairs``: None = full round (every owner to all its holders). A set of
        (owner, holder) pairs = a partial round: only those pairs move bytes;
        for every other pair of the placement the holder must already hold
        this very image of ``manifest.version`` (any generation), else the
        round does not commit. ``MISSING`` = the engine computes that set
        itself at the start of the round (owner and holder swap image
        fingerprints, on the background thread). Every rank must pass the
        same value. A manifest with no ``chunk_checksums`` (captured with
        ``checksum_now=False``) is checksummed at the start of its round, on
        the background thread; until then it is not one of :meth:`own_images`.
        ``fence``: the capture's device-to-host copies still in flight into
        ``buffer`` (:mod:`ckptless.state.fence`); the round waits for them
        before it reads a byte, and an image the fence calls torn is never
        mirrored (the engine breaks: a fault, the job rolls back). ``live``: a deferred capture, whose
        ``buffer`` holds the suffix alone (:mod:`ckptless.mirror.pool`).
        """
        if fence is not None:  # before anything can raise: the buffer is not dropped under its copies
            with self._cond:
                entry = self._entry(buffer)
                if entry is not None:
                    entry.fence = fence
        self._raise_if_broken()
        if pairs is not None and pairs != MISSING:
            pairs = check_pairs(self.placement, pairs)
        need = manifest.total_bytes - (live.nbytes if live is not None else 0)
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() < need:
            raise MirrorError("image buffer must be a contiguous 1-D uint8 tensor of >= total_bytes (less a live prefix)")
        with self._cond:
            entry = self._entry(buffer)
            if entry is None:  # a foreign buffer: adopted into the pool, caller must not reuse it
                entry = _Buf(buffer)
                self._pool.append(entry)
            entry.state, entry.manifest, entry.fence, entry.live = QUEUED, manifest, fence, live
        if self._thread is None:
            self._round(manifest, buffer, pairs)
            self._raise_if_broken()
        else:
            self._queue.put((manifest, buffer, pairs))

    def wait_committed(self, version: int, timeout: float) -> bool:
        """Block until ``version`` (or newer) is committed; False on timeout, or at once when every round
        submitted has ended and none committed it (it never will: only a round commits); raises if broken."""
        end = time.monotonic() + timeout
        with self._cond:
            while self.committed_version is None or self.committed_version < version:
                self._raise_if_broken()
                if (self._last_round is not None and self._last_round >= version
                        and not any(b.state in (QUEUED, INFLIGHT) for b in self._pool)):
                    return False
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Block until every submitted round has finished (committed or not); raises if broken."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_broken()
                if not any(b.state in (QUEUED, INFLIGHT) for b in self._pool):
                    return True
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    # --- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self.error is not None:
                return
            self._round(*item)

    def _round(self, manifest: Manifest, buffer: torch.Tensor, spec: PairSpec = None) -> None:
        t0 = time.monotonic()
        with self._cond:
            entry = self._entry(buffer)
            assert entry is not None
            entry.state = INFLIGHT
            fence = entry.fence
        try:
            if fence is not None:  # an asynchronous capture: its copies must be done, and clean
                fence.wait(self.config.timeout_s, f"the capture of v{manifest.version}")
                torn = fence.seal()
                if torn is not None:
                    with self._cond:
                        entry.manifest = None  # never one of own_images(), whatever its manifest says
                    raise MirrorError(f"image v{manifest.version} of rank {self.rank} is not mirrored: {torn}")
                entry.fence = None  # done: nothing to wait for, and its source tensors need not stay alive
            untrusted = None  # why a live prefix's checksums prove nothing this round
            if not _has_checksums(manifest):  # captured with checksum_now=False: checksummed here,
                # off the training thread (crc32c releases the GIL); nothing writes the buffer now
                manifest, untrusted = self._checksum(manifest, buffer, entry)
                with self._cond:
                    entry.manifest = manifest
            deadline = Deadline(self.config.timeout_s)
            live = entry.live
            local = replica_check.check(self.group, self.rank, manifest, deadline,  # never committed if diverged
                                        abstain=untrusted is not None, read=self._prefix_reader(buffer, live),
                                        still_valid=lambda: live is None or live.changed() is None)
            diverged = local is not None and local.diverged
            pairs = self._missing_pairs(manifest, deadline) if spec == MISSING else spec
            assert pairs is None or isinstance(pairs, frozenset)
            send_to, recv_from = split(pairs, self.rank, self.placement)
            res = self.transport.exchange(manifest, buffer, self.store, deadline, send_to=send_to,
                                          recv_from=recv_from, buffer_base=entry.live.nbytes if entry.live else 0)
            outcome = self._agree(res, deadline, not diverged and untrusted is None, diverged)
            verdict: tuple[replica_verdict.Verdict, str] | None = None
            if outcome.diverged and local is not None:  # some set diverged: every set decides from its evidence,
                # on a deadline of its own (the transfer may have spent the round's)
                verdict = replica_check.decide(
                    self.group, local, manifest, self.layout, self.strikes, self.placement.holders,
                    self.config.on_replica_mismatch,
                    Deadline(min(self.config.timeout_s, replica_check.EVIDENCE_S)))
        except Exception as exc:  # any failure leaves the group in an unknown state
            log.error("mirror round v%d failed on rank %d: %s", manifest.version, self.rank, exc)
            with self._cond:
                self.error = exc
                entry.state = FREE  # unsealed or torn, it has no checksums: never one of own_images()
                self._cond.notify_all()
            return
        committed_here = outcome.advanced and outcome.committed == manifest.version
        holder: _Buf | None = entry  # the buffer holding this version whole once committed (None: none)
        if entry.live is not None:  # the live prefix and the suffix, over the committed buffer
            holder = self._merge(entry, manifest) if committed_here else None
        files = self.own_files if committed_here and holder is not None else None
        if files is not None and holder is not None:
            files.publish(holder.path, manifest)  # the newer manifest first: one always tells the truth
        with self._cond:
            if outcome.advanced:
                for b in self._pool:
                    if b.state == COMMITTED:
                        if self.own_files is not None:
                            self.own_files.retract(b.path)
                        b.state = FREE
                if holder is not None:
                    holder.state = COMMITTED
                if holder is not entry:  # a deferred capture: its suffix buffer is free again
                    entry.state, entry.manifest, entry.live = FREE, None, None
                self.committed_version = outcome.committed
                self.store.pin(outcome.committed)
            else:
                entry.state = FREE
            self.history.append(RoundStats(manifest.version, self.committed_version, time.monotonic() - t0,
                                           res.bytes_sent, res.bytes_received, res.corrupt, pairs,
                                           tuple(res.kept), tuple(res.missing)))
            if res.missing:
                log.warning("round v%d not committable: rank %d lacks the kept images of owners %s",
                            manifest.version, self.rank, res.missing)
            if not outcome.in_step:
                self.error = MirrorError(f"ranks are out of step in round v{manifest.version}")
            self._last_round = manifest.version
            # A deferred verdict is decided by the next round, at the latest (replica_verdict.decide).
            self.strikes.deferred = verdict is not None and verdict[0].kind == "defer"
            if verdict is not None and local is not None:  # only the proven copy stays a restore source
                found, keep = replica_check.settle(*verdict, local, self.config.on_replica_mismatch, self.layout,
                                                   self.strikes, first=self._first_of_set(manifest))
                self.error = found or self.error
                entry.manifest = entry.manifest if keep else None
            if untrusted is not None and self.live_torn is None:
                self.live_torn = untrusted
                log.warning("rank %d: %s; captures copy the whole image from now on", self.rank, untrusted)
            self._cond.notify_all()
        if files is not None:
            files.sweep_others()
        if outcome.advanced and self.on_commit is not None and outcome.committed is not None:
            self.on_commit(outcome.committed)

    def _prefix_reader(self, buffer: torch.Tensor, live: LivePrefix | None) -> replica_check.Reader:
        """Where the replica check reads a prefix tensor's bytes: the live tensors of a deferred capture,
        else the capture buffer (which holds the image from byte 0)."""
        if live is not None:
            return lambda e: live.bytes_at(e.offset)
        return lambda e: buffer[e.offset: e.offset + e.nbytes].numpy().data

    def _first_of_set(self, manifest: Manifest) -> bool:
        from ckptless.state import region_of

        region = region_of(manifest)
        return region is not None and region.ranks.at(0) == self.rank

    def _checksum(self, manifest: Manifest, buffer: torch.Tensor, entry: _Buf) -> tuple[Manifest, str | None]:
        """The image's chunk checksums, a deferred prefix's read from the live tensors; and why those
        prove nothing (written under the read, or abandoned for a restore), or None."""
        live, total = entry.live, manifest.total_bytes
        if live is None:
            return dataclasses.replace(manifest, chunk_checksums=tuple(
                chunk_checksums(buffer, manifest.chunk_bytes, total))), None
        sums = live.checksums(manifest.chunk_bytes) + chunk_checksums(buffer, manifest.chunk_bytes, total - live.nbytes)
        untrusted = live.changed() or ("abandoned (a recovery, or an optimizer step that outwaited its round)"
                                     if entry.abandoned else None)
        return dataclasses.replace(manifest, chunk_checksums=tuple(sums)), untrusted

    def _missing_pairs(self, manifest: Manifest, deadline: Deadline) -> frozenset[Pair]:
        """The pairs of this rank whose holder lacks this round's image (the :data:`MISSING` rule).

        Each end of a pair learns the other's fingerprint of the owner's image
        from the pair itself (:func:`agreement.digest_exchange`: 2K messages of
        8 bytes, one hop), so both decide alike, and no rank sees the W x K
        facts of pairs it is not in. Only this rank's pairs are returned: all
        that :func:`split` reads from them.
        """
        owners = self.placement.owners_held_by(self.rank)
        held = {o: digest(self.store.verified_copy(o, manifest.version)) for o in owners}
        own = digest(manifest)
        theirs, owner_digests = agreement.digest_exchange(self.group, own, self.placement.holders(self.rank),
                                                          held, deadline)
        return my_missing_pairs(self.rank, own, theirs, held, owner_digests)

    def _agree(self, res: RoundResult, deadline: Deadline, own_ok: bool, diverged: bool = False) -> RoundOutcome:
        """The round's acks, reduced with MIN over the agreement tree (``2 * depth(W)`` hops); also tells
        every rank whether any rank's replicas diverged."""
        ok = {o: o in res.received for o in self.transport.owners}
        vec = encode(round_ack(res.version, own_ok, ok), res.version, diverged)
        reduced = agreement.tree_allreduce(self.group, self.rank, self.world_size, vec, "min", deadline,
                                           "commit agreement")
        return decide(reduced, self.committed_version)

    # --- shutdown ---------------------------------------------------------------------------------
    def retire(self) -> None:
        """Stop after the current round (which fails once its peers are gone); do not wait."""
        self.abandon_deferred()  # a restore may write the live tensors next: no merge from them
        self._queue.put(None)

    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def release_group(self) -> dist.ProcessGroup | None:
        """Give up the engine's references to its mirror group (a retired engine whose thread ended);
        returns the group, for the caller to drop off the training thread (its destructor joins Gloo's
        threads, which may wait on a dead peer until the timeout), or None if it held none.

        Why: its Gloo device keeps a listener and threads open while the group lives (one listener
        more per recovery, docs/scale.md). Why only now: freeing a group while the engine's thread is
        in a Gloo call on it aborts the process; once the thread ended, none of ours is on it."""
        group = self.group
        self.group = None  # type: ignore[assignment]  # retired: no method of this engine uses it again
        self.transport.group = None  # type: ignore[assignment]
        return group

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop after queued rounds; raises TransportError if it does not stop in time."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TransportError(f"mirror thread of rank {self.rank} did not stop within {timeout}s")
            self._thread = None
        for b in self._pool:
            if b.path is not None:
                buffers.drop(b.tensor, b.path, b.fence, self.config.timeout_s)
        if self.own_files is not None:
            self.own_files.close()  # a clean end: nothing will be respawned from them
