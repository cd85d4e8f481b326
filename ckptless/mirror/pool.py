"""The owner-side buffer pool of a :class:`~ckptless.mirror.mirror.MirrorEngine`: what each capture
buffer holds when, and the deferred replicated prefix.

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

**The deferred prefix** (issue 21; :mod:`ckptless.state.live_prefix`). With ``pool_buffers=2`` and an
image whose replicated prefix is not mirrored and lives in CPU tensors, a capture after the first
copies only the private suffix into a small buffer (``acquire_buffer(n, shrink=True)``) and hands the
engine the live prefix (``submit(..., live=...)``). Its round checksums the prefix from the live
tensors; if the version commits, the engine copies the live prefix and the suffix over the committed
buffer (:meth:`OwnerPool._merge`: state ``MERGING``, its node-local manifest retracted first and the new
one published after), so one buffer holds the committed image, whole, as before. The optimizer step
that follows waits in :meth:`OwnerPool.settle_prefix` until that round is over: the live tensors are
the captured version until then. A round that ends without a commit merges nothing (the committed
buffer keeps the older version). Host memory: one S plus the suffix, instead of two S.

* An outstanding deferred capture is never merged once *abandoned* (the settle timed out and the
  optimizer wrote, or the engine was retired for a recovery): that rank then holds no whole copy of
  the version, and a recovery resuming there restores it from a replica (the planner's rule for any
  rank that does not report a version locally).
* A version counter that moved (a write outside the optimizer step) during the round or the merge
  makes the image untrusted (``live_torn``): the rank abstains from the replica check and does not
  acknowledge the round, a torn merge leaves no committed copy, and the caller captures classically
  from then on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckptless.errors import MirrorError
from ckptless.mirror import buffers
from ckptless.mirror.config import MirrorConfig
from ckptless.mirror.ownimage import OwnImageFiles
from ckptless.mirror.store import StoredImage
from ckptless.state import CopyFence
from ckptless.state import LivePrefix
from ckptless.state import Manifest

log = logging.getLogger(__name__)

FREE, CAPTURING, QUEUED, INFLIGHT, COMMITTED = "free", "capturing", "queued", "inflight", "committed"
MERGING = "merging"  # the committed buffer, being overwritten with the newer committed version
SHRINK_SLACK = 1 << 20  # a free buffer this much above twice what a deferred capture needs is shrunk


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
    live: LivePrefix | None = None  # a deferred capture: ``tensor`` holds the suffix only
    abandoned: bool = False  # a deferred capture that must never be merged (module doc)


class OwnerPool:
    """The pool half of the engine (a mixin: it shares the engine's lock, configuration and error)."""

    config: MirrorConfig
    own_files: OwnImageFiles | None
    error: BaseException | None
    _pool: list[_Buf]
    _cond: threading.Condition
    live_torn: str | None = None  # why a deferred capture was found written under it (module doc)

    def _raise_if_broken(self) -> None:  # the engine's
        raise NotImplementedError

    def acquire_buffer(self, nbytes: int, timeout: float | None = None, shrink: bool = False) -> torch.Tensor:
        """A 1-D uint8 CPU buffer of >= ``nbytes`` to capture into (see module doc for lifetime).
        ``shrink``: a free buffer much larger than needed is shrunk first (a deferred capture's suffix
        must not keep a whole S alive)."""
        deadline = time.monotonic() + (self.config.timeout_s if timeout is None else timeout)
        with self._cond:
            while True:
                self._raise_if_broken()
                free = [b for b in self._pool if b.state == FREE]
                fit = [b for b in free if b.tensor.numel() >= nbytes]
                if fit:
                    buf = min(fit, key=lambda b: b.tensor.numel())
                    if shrink and buf.tensor.numel() > 2 * nbytes + SHRINK_SLACK:
                        self._regrow(buf, nbytes)
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
                buf.state, buf.manifest, buf.live, buf.abandoned = CAPTURING, None, None, False
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

    def pool_bytes(self) -> int:
        """Host bytes the pool's capture buffers hold (this rank's own images, whole or suffix)."""
        with self._cond:
            return sum(b.tensor.numel() for b in self._pool)

    def pool_ptrs(self) -> list[int]:
        return [b.tensor.data_ptr() for b in self._pool]

    def local_image(self, version: int | None = None) -> StoredImage | None:
        """The owner's own copy of the committed version (default) for local rollback."""
        with self._cond:
            self._wait_merged()
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
            self._wait_merged()
            return [StoredImage(b.manifest, b.tensor[: b.manifest.total_bytes])
                    for b in self._pool if b.manifest is not None and b.state not in (CAPTURING, MERGING)
                    and b.live is None and _has_checksums(b.manifest)]

    def _wait_merged(self) -> None:
        """(Lock held.) A merge is a bounded local copy: wait for it, so that no image is handed out torn."""
        end = time.monotonic() + self.config.timeout_s
        while any(b.state == MERGING for b in self._pool) and time.monotonic() < end:
            self._cond.wait(end - time.monotonic())

    # --- the deferred prefix (module doc) ----------------------------------------------------------
    def committed_room(self) -> int:
        """Size of the buffer holding the committed version (0: none): a deferred capture's image must
        fit it, since the merge writes it there."""
        with self._cond:
            return max((b.tensor.numel() for b in self._pool
                        if b.state == COMMITTED and b.manifest is not None and b.live is None), default=0)

    def settle_prefix(self, timeout: float) -> bool:
        """Block until no deferred capture's round is queued, in flight or merging: the live tensors
        may be written then (called before every optimizer step). Never raises. On timeout, or once the
        engine is broken, the outstanding capture is abandoned (never merged later) and False returned."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                busy = [b for b in self._pool if b.live is not None and b.state in (QUEUED, INFLIGHT)]
                merging = any(b.state == MERGING for b in self._pool)
                if not busy and not merging:
                    return True
                left = end - time.monotonic()
                if (left <= 0 or self.error is not None) and not merging:
                    for b in busy:
                        b.abandoned = True
                    log.warning("the round of a deferred capture did not end before the optimizer step (%s): "
                                "that version is not kept here", "engine broken" if self.error else "timeout")
                    return False
                self._cond.wait(max(left, 0.05) if left > 0 else 0.05)

    def abandon_deferred(self) -> None:
        """Never merge an outstanding deferred capture (the engine is retired: a restore may write the
        live tensors next)."""
        with self._cond:
            for b in self._pool:
                if b.live is not None:
                    b.abandoned = True

    def _merge(self, entry: _Buf, manifest: Manifest) -> _Buf | None:
        """Copy a committed deferred capture over the committed buffer (engine thread, at commit);
        returns the buffer now holding ``manifest``'s whole image (state ``MERGING``: the caller makes it
        COMMITTED), or None when none does (abandoned, no room, or written under the copy)."""
        live = entry.live
        assert live is not None
        total = manifest.total_bytes
        with self._cond:
            target = next((b for b in self._pool if b.state == COMMITTED and b.live is None
                           and b.tensor.numel() >= total), None)
            if target is None or entry.abandoned:
                return None
            target.state, target.manifest = MERGING, None
        if self.own_files is not None:
            self.own_files.retract(target.path)  # before a byte of it is overwritten
        try:
            live.copy_into(target.tensor)
            target.tensor[live.nbytes:total].copy_(entry.tensor[: total - live.nbytes])
            torn = live.changed()
        except Exception as exc:  # never into the round: the version stays committed elsewhere
            torn = f"the merge failed: {exc}"
        with self._cond:
            if torn is None:
                target.manifest = manifest
                return target
            target.state = FREE
            self.live_torn = torn
            self._cond.notify_all()
        log.warning("rank's own copy of v%d is not kept: %s; captures copy the whole image from now on",
                    manifest.version, torn)
        return None

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
