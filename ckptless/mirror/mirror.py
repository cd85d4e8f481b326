"""MirrorEngine: the background mirror loop, its owner-side buffer pool and commits.

Why a background thread: the training step must only wait for its local copy
(the capture into a pool buffer); sending to K peers and receiving their
images run on the dedicated mirror group meanwhile.

Buffer pool lifetime rules (``MirrorConfig.pool_buffers``):

* ``acquire_buffer(n)`` hands out a FREE buffer (>= n bytes) to capture into;
  it blocks (up to ``timeout_s``) only if all buffers are busy, i.e. when
  mirroring is slower than ``mirror_every`` steps: that is back-pressure.
* ``submit(manifest, buffer)`` hands it to the engine; the caller must not
  write to it afterwards. ``release_buffer`` returns an unused one.
* The engine keeps the buffer of the newest *committed* version (the owner's
  own copy, for local rollback: ``local_image()``); it becomes FREE when a
  newer version commits. An in-flight buffer becomes FREE when its round ends
  without a commit.
* ``pool_buffers=2`` (default): committed + in flight. Capturing v+1 waits only while v's round
  is still running, so a step longer than a round never waits, and a committed local copy always
  exists (survivors roll back from local memory). ``3`` also lets one capture run ahead of a slow
  round (absorbs jitter when step < round) for one more S of memory.
* ``pool_buffers=1`` (memory budget: host memory (2 + 2K) x S with the live
  state in host memory): capturing v+1 reuses the buffer of committed v once
  no round is queued or in flight (it blocks while v's round still sends).
  Trade-off: from then until v+1 commits this rank has *no local copy of the
  committed version*; if a failure hits in that window and recovery resumes
  at v, this rank receives v from its holders (the planner does that for any
  rank that does not report v locally) instead of restoring it in place.

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
from ckptless.mirror import agreement, buffers, replica_check
from ckptless.mirror.commit import RoundOutcome, decide, encode, round_ack
from ckptless.mirror.config import MirrorConfig
from ckptless.mirror.partial import MISSING, Pair, PairSpec, check_pairs, digest, my_missing_pairs, split
from ckptless.mirror.ownimage import OwnImageFiles
from ckptless.mirror.placement import Placement, compute_placement
from ckptless.mirror.store import PeerStore, StoredImage
from ckptless.mirror.transport import Deadline, MirrorTransport, RoundResult
from ckptless.state.checksum import chunk_checksums
from ckptless.state.fence import CopyFence
from ckptless.state.manifest import Manifest

log = logging.getLogger(__name__)

FREE, CAPTURING, QUEUED, INFLIGHT, COMMITTED = "free", "capturing", "queued", "inflight", "committed"


def _has_checksums(m: Manifest) -> bool:
    """False for an image captured with ``checksum_now=False`` whose round has not checksummed it yet."""
    return bool(m.chunk_checksums) or m.total_bytes == 0


@dataclass
class _Buf:
    tensor: torch.Tensor
    state: str = FREE
    manifest: Manifest | None = None
    path: str | None = None  # its file in shm_dir (node-local tier), None: anonymous memory
    fence: CopyFence | None = None  # device-to-host copies of its capture still in flight


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


class MirrorEngine:
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
    ) -> None:
        self.config = config or MirrorConfig()
        self.rank = group.rank()
        self.world_size = group.size()
        self.config.validate_for_world(self.world_size)
        self.placement = placement or compute_placement(
            self.world_size, self.config.replicas, self.config.placement, node_of)
        self.job_id, self.generation = job_id, generation
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

    # --- buffer pool ----------------------------------------------------------------------
    def acquire_buffer(self, nbytes: int, timeout: float | None = None) -> torch.Tensor:
        """A 1-D uint8 CPU buffer of >= ``nbytes`` to capture into (see module doc for lifetime)."""
        deadline = time.monotonic() + (self.config.timeout_s if timeout is None else timeout)
        with self._cond:
            while True:
                self._raise_if_broken()
                free = [b for b in self._pool if b.state == FREE]
                fit = [b for b in free if b.tensor.numel() >= nbytes]
                if fit:
                    buf = min(fit, key=lambda b: b.tensor.numel())
                elif free:  # grow one (sizes changed): the only allocation after warm-up
                    buf = free[0]
                    self._regrow(buf, nbytes)
                elif len(self._pool) < self.config.pool_buffers:
                    tensor, path = self._allocate(nbytes)
                    buf = _Buf(tensor, path=path)
                    self._pool.append(buf)
                elif (reuse := self._reusable_committed()) is not None:
                    buf = reuse  # pool_buffers=1: the committed local copy is given up (module doc)
                    if self.own_files is not None:
                        self.own_files.retract(buf.path)  # before a byte of it is overwritten
                    if buf.tensor.numel() < nbytes:
                        self._regrow(buf, nbytes)
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise MirrorError(f"no free capture buffer within the deadline ({len(self._pool)} busy): "
                                          "mirroring is slower than mirror_every steps")
                    self._cond.wait(left)
                    continue
                buf.state, buf.manifest = CAPTURING, None
                return buf.tensor

    def _allocate(self, nbytes: int) -> tuple[torch.Tensor, str | None]:
        return buffers.allocate(self.own_files, nbytes)  # page-locked when the process uses CUDA

    def _regrow(self, buf: _Buf, nbytes: int) -> None:
        buffers.drop(buf.tensor, buf.path, buf.fence, self.config.timeout_s)
        buf.tensor, buf.fence = torch.empty(0, dtype=torch.uint8), None  # free the old one first
        if self.own_files is not None:
            self.own_files.release(buf.path)
        buf.tensor, buf.path = self._allocate(nbytes)

    def _reusable_committed(self) -> _Buf | None:
        """With one buffer: the committed one, once no round is queued or in flight."""
        if self.config.pool_buffers > 1 or any(b.state in (QUEUED, INFLIGHT) for b in self._pool):
            return None
        return next((b for b in self._pool if b.state == COMMITTED), None)

    def release_buffer(self, tensor: torch.Tensor) -> None:
        with self._cond:
            for b in self._pool:
                if b.tensor.data_ptr() == tensor.data_ptr() and b.state == CAPTURING:
                    b.state = FREE
                    self._cond.notify_all()

    def _entry(self, tensor: torch.Tensor) -> _Buf | None:
        for b in self._pool:
            if b.tensor.data_ptr() == tensor.data_ptr():
                return b
        return None

    def pool_ptrs(self) -> list[int]:
        return [b.tensor.data_ptr() for b in self._pool]

    def local_image(self, version: int | None = None) -> StoredImage | None:
        """The owner's own copy of the committed version (default) for local rollback."""
        with self._cond:
            for b in self._pool:
                if b.manifest is not None and b.state == COMMITTED and (version is None or b.manifest.version == version):
                    return StoredImage(b.manifest, b.tensor[: b.manifest.total_bytes])
        return None

    def own_images(self) -> list[StoredImage]:
        """Every image of this rank still intact in the pool (committed, in flight or queued).

        Used for rollback after the engine broke: the resume version chosen by
        recovery may be the committed one or a newer one whose round did not
        finish everywhere. Callers verify checksums before restoring.
        """
        with self._cond:
            return [StoredImage(b.manifest, b.tensor[: b.manifest.total_bytes])
                    for b in self._pool if b.manifest is not None and b.state != CAPTURING
                    and _has_checksums(b.manifest)]

    # --- submission -------------------------------------------------------------------------
    def submit(self, manifest: Manifest, buffer: torch.Tensor, pairs: PairSpec = None,
               fence: CopyFence | None = None) -> None:
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
        mirrored (the engine breaks: a fault, the job rolls back).
        """
        if fence is not None:  # before anything can raise: the buffer is not dropped under its copies
            with self._cond:
                entry = self._entry(buffer)
                if entry is not None:
                    entry.fence = fence
        self._raise_if_broken()
        if pairs is not None and pairs != MISSING:
            pairs = check_pairs(self.placement, pairs)
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() < manifest.total_bytes:
            raise MirrorError("image buffer must be a contiguous 1-D uint8 tensor of >= total_bytes")
        with self._cond:
            entry = self._entry(buffer)
            if entry is None:  # a foreign buffer: adopted into the pool, caller must not reuse it
                entry = _Buf(buffer)
                self._pool.append(entry)
            entry.state, entry.manifest, entry.fence = QUEUED, manifest, fence
        if self._thread is None:
            self._round(manifest, buffer, pairs)
            self._raise_if_broken()
        else:
            self._queue.put((manifest, buffer, pairs))

    def wait_committed(self, version: int, timeout: float) -> bool:
        """Block until ``version`` (or newer) is committed; False on timeout; raises if broken."""
        end = time.monotonic() + timeout
        with self._cond:
            while self.committed_version is None or self.committed_version < version:
                self._raise_if_broken()
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
            if not _has_checksums(manifest):  # captured with checksum_now=False: checksummed here,
                # off the training thread (crc32c releases the GIL); nothing writes the buffer now
                sums = tuple(chunk_checksums(buffer, manifest.chunk_bytes, manifest.total_bytes))
                manifest = dataclasses.replace(manifest, chunk_checksums=sums)
                with self._cond:
                    entry.manifest = manifest
            deadline = Deadline(self.config.timeout_s)
            diverged = replica_check.check(self.group, self.rank, manifest, deadline)  # never committed if so
            pairs = self._missing_pairs(manifest, deadline) if spec == MISSING else spec
            assert pairs is None or isinstance(pairs, frozenset)
            send_to, recv_from = split(pairs, self.rank, self.placement)
            res = self.transport.exchange(manifest, buffer, self.store, deadline,
                                          send_to=send_to, recv_from=recv_from)
            outcome = self._agree(res, deadline, diverged is None)
        except Exception as exc:  # any failure leaves the group in an unknown state
            log.error("mirror round v%d failed on rank %d: %s", manifest.version, self.rank, exc)
            with self._cond:
                self.error = exc
                entry.state = FREE  # unsealed or torn, it has no checksums: never one of own_images()
                self._cond.notify_all()
            return
        files = self.own_files if outcome.advanced and outcome.committed == manifest.version else None
        if files is not None:
            files.publish(entry.path, manifest)  # the newer manifest first: one always tells the truth
        with self._cond:
            if outcome.advanced:
                for b in self._pool:
                    if b.state == COMMITTED:
                        if self.own_files is not None:
                            self.own_files.retract(b.path)
                        b.state = FREE
                entry.state = COMMITTED
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
            if diverged is not None:  # never a restore source where this rank may hold the bad copy
                self.error, keep = replica_check.settle(diverged, self.config.on_replica_mismatch, self.error)
                entry.manifest = entry.manifest if keep else None
            self._cond.notify_all()
        if files is not None:
            files.sweep_others()
        if outcome.advanced and self.on_commit is not None and outcome.committed is not None:
            self.on_commit(outcome.committed)

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

    def _agree(self, res: RoundResult, deadline: Deadline, own_ok: bool) -> RoundOutcome:
        """The round's acks, reduced with MIN over the agreement tree (``2 * depth(W)`` hops)."""
        ok = {o: o in res.received for o in self.transport.owners}
        vec = encode(round_ack(res.version, own_ok, ok), res.version)
        reduced = agreement.tree_allreduce(self.group, self.rank, self.world_size, vec, "min", deadline,
                                           "commit agreement")
        return decide(reduced, self.committed_version)

    # --- shutdown ---------------------------------------------------------------------------------
    def retire(self) -> None:
        """Stop after the current round (which fails once its peers are gone); do not wait."""
        self._queue.put(None)

    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def release_pool(self) -> None:
        """Drop the engine's references to its capture buffers (a retired engine whose thread ended).

        Why it is safe: a Gloo operation still in flight holds its own reference to
        the tensors it reads or writes, and images handed out by :meth:`own_images`
        hold theirs; what is dropped here is only the pool's. Without this, every
        recovery left one to three S-sized buffers per rank alive for the rest of the job.
        A buffer's copies in flight are waited for and its registration ended first (``buffers.drop``).
        """
        with self._cond:
            pool, self._pool = self._pool, []
        for b in pool:
            buffers.drop(b.tensor, b.path, b.fence, self.config.timeout_s)

    def release_group(self) -> bool:
        """Drop the engine's references to its mirror group (a retired engine whose thread ended);
        returns True if it held one.

        Why: its Gloo device keeps a listener and threads open while the group lives (one listener
        more per recovery, docs/scale.md). Why only now: freeing a group while the engine's thread is
        in a Gloo call on it aborts the process; once the thread ended, none of ours is on it."""
        held = self.group is not None
        self.group = None  # type: ignore[assignment]  # retired: no method of this engine uses it again
        self.transport.group = None  # type: ignore[assignment]
        return held

    def take_pool(self) -> list[torch.Tensor]:
        """Hand over the pool's plain-memory buffers and forget them (a retired engine whose thread ended).

        File-backed buffers (node-local tier) stay with their files and are not handed out.
        """
        with self._cond:
            pool, self._pool = self._pool, []
        for b in pool:  # a queued round that never ran may have left its capture's copies in flight
            buffers.drop(b.tensor, b.path, b.fence, self.config.timeout_s)
        return [b.tensor for b in pool if b.path is None]

    def donate(self, tensors: Sequence[torch.Tensor]) -> int:
        """Add FREE buffers to the pool, up to ``pool_buffers``; returns how many were taken.

        Why: buffers of the previous generation's engine are already faulted in;
        reusing them keeps page faults off the first captures after a recovery.
        Not for the node-local tier, whose pool buffers are files.
        """
        taken = 0
        with self._cond:
            if self.own_files is not None:
                return 0
            for t in tensors:
                if len(self._pool) >= self.config.pool_buffers:
                    break
                if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous() or self._entry(t) is not None:
                    continue
                self._pool.append(_Buf(t))
                taken += 1
            if taken:
                self._cond.notify_all()
        return taken

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
