"""Peer store: the images this rank holds for other ranks, double-buffered.

Two slots per owner (:mod:`ckptless.mirror.slots` says why): the newest
complete image and the one being written, reused for every version.

Optional ``/dev/shm`` backing (:mod:`ckptless.mirror.slot_files`): a slot's
bytes then live in a file that outlives this process, and a respawned holder
re-attaches them (:func:`ckptless.mirror.reattach.attach`). The rules here do
not depend on where the bytes are.

Why verdicts are cached: a replica is checksummed when it lands; at rest it can
still rot (a bit flip, a stray writer). :meth:`PeerStore.verified_replicas`
re-checks only what may have changed since (file stat changed, or the verdict
is older than the caller allows), so a call right after a round costs a stat
per file, and recovery never reports a replica it could not serve.

Ordering: images are ordered by ``(generation, version)``; an image not newer
than the newest complete one is rejected (:class:`StaleVersion`), as is one
from another job or an older generation (:class:`StaleGeneration`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ckptless.errors import ConfigError, IntegrityError, MirrorError, StaleGeneration
from ckptless.mirror.shm import FallbackNotice, file_prefix
from ckptless.mirror.slot_files import SlotFiles
from ckptless.mirror.slots import OwnerSlots, Slot, image_key
from ckptless.state import bad_held_chunks, held_bytes, held_from
from ckptless.state import manifest_layout_key
from ckptless.state import Manifest


class Image(Protocol):
    """Structural twin of ``ckptless.state.capture.StateImage``."""

    manifest: Manifest
    buffer: torch.Tensor


@dataclass
class StoredImage:
    """A complete image held by the store; ``buffer`` is a view into a slot (do not write).

    ``buffer`` holds the image from ``replication.held_from(manifest)`` on: a holder keeps no copy of a
    replicated prefix that live replicas hold (:mod:`ckptless.state.replication`); byte ``b`` of the
    image is ``buffer[b - held_from(manifest)]``."""

    manifest: Manifest
    buffer: torch.Tensor


class StaleVersion(StaleGeneration, MirrorError):
    """An image is not newer than the one already held for its owner."""


__all__ = ["AtRest", "Image", "PeerStore", "StaleVersion", "StoredImage", "file_prefix"]  # file_prefix: re-export


@dataclass(frozen=True)
class AtRest:
    """Result of re-checking the complete replicas a store holds.

    ``verified``: ``(owner, version, n_chunks)`` whose checksums match now;
    ``corrupt``: ``(owner, version, bad chunk indices)``.
    """

    verified: list[tuple[int, int, int]]
    corrupt: list[tuple[int, int, list[int]]]


class PeerStore:
    """Holds other ranks' images; thread-safe for one writer plus readers.

    ``holder`` (this process's rank) and ``node`` (a stable id of its node,
    e.g. the agent's node id) name the ``/dev/shm`` files; a file-backed store
    needs ``holder``, an in-memory one ignores both. A fresh file-backed store
    deletes what an earlier incarnation of the same (job, node, holder) left:
    use :func:`ckptless.mirror.reattach.attach` to keep it.
    """

    def __init__(self, job_id: str, generation: int = 0, shm_dir: str | None = None, *,
                 holder: int | None = None, node: str | None = None, keep_files: bool = False) -> None:
        if shm_dir is not None and holder is None:
            raise ConfigError("holder", holder, "a /dev/shm-backed store needs its holder rank: "
                                                "holders sharing a host would otherwise share files")
        self.job_id = job_id
        self._generation = generation
        self.shm_dir = shm_dir
        self.holder = holder
        self.node = node
        self._owners: dict[int, OwnerSlots] = {}
        self._lock = threading.Lock()
        self.rejected: list[tuple[str, str]] = []  # (path, reason) from attach()
        self._pinned: int | None = None
        self.fallback = FallbackNotice(shm_dir or "", f"holder rank {holder}",
                                       "it does not outlive this process: a respawned holder gets it mirrored again")
        self.files: SlotFiles | None = None  # where the slots' bytes live; None: memory only
        if shm_dir is not None and holder is not None:  # (a holder is required with shm_dir: checked above)
            self.files = SlotFiles(shm_dir, job_id, node, holder, self.fallback)
            if not keep_files:
                self.files.unlink_all()

    # --- generation -----------------------------------------------------------
    @property
    def generation(self) -> int:
        return self._generation

    def set_generation(self, generation: int) -> None:
        """Fence: from now on images of older generations are rejected."""
        with self._lock:
            if generation < self._generation:
                raise StaleGeneration(f"store is at generation {self._generation}, refusing {generation}")
            self._generation = generation

    def pin(self, version: int | None) -> None:
        """Protect the committed version: its slot is never chosen for writing.

        Why: if round v+1 fails after some holders completed v+1, the slot that
        still holds committed v must survive round v+2 as well.
        """
        with self._lock:
            self._pinned = version

    # --- where a slot's bytes live ------------------------------------------------
    def _ensure_capacity(self, owner: int, idx: int, slot: Slot, nbytes: int) -> torch.Tensor:
        """The slot's buffer, grown to ``nbytes``: its shm file's pages reserved, or memory if they cannot be."""
        nbytes = max(nbytes, 1)  # zero-length mappings are not allowed
        if slot.buffer is not None and slot.capacity >= nbytes:
            return slot.buffer
        slot.buffer, slot.in_file = None, False  # drop the old mapping before growing
        mapped = None if self.files is None else self.files.reserve(owner, idx, nbytes)
        if mapped is not None:
            slot.buffer, slot.in_file = mapped, True
            return slot.buffer
        slot.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return slot.buffer

    def _stat(self, owner: int, idx: int) -> tuple[int, int, int, int] | None:
        return None if self.files is None else self.files.stat(owner, idx)

    # --- write path -------------------------------------------------------------
    def check(self, manifest: Manifest) -> None:
        """Raise if ``manifest`` may not be stored (wrong job, old generation, not newer)."""
        if manifest.job_id != self.job_id:
            raise StaleGeneration(f"image of job {manifest.job_id!r} offered to store of job {self.job_id!r}")
        if manifest.generation < self._generation:
            raise StaleGeneration(
                f"image of owner {manifest.owner} is from generation {manifest.generation} < {self._generation}"
            )
        own = self._owners.get(manifest.owner)
        if own is not None:
            newest = own.newest()
            if newest is not None:
                held = own.slots[newest].complete
                assert held is not None
                if image_key(manifest) <= image_key(held):
                    raise StaleVersion(f"owner {manifest.owner}: (gen, version) {image_key(manifest)} "
                                       f"is not newer than held {image_key(held)}")

    def begin(self, manifest: Manifest) -> torch.Tensor:
        """Reserve the writing slot for ``manifest``; returns the view to fill (the held bytes: total_bytes
        less a replicated prefix, see :class:`StoredImage`).

        The slot that does not hold the newest complete image is reused; whatever
        older image it held is forgotten now (its manifest file first, so the
        half-written payload is never mistaken for a complete one).
        """
        manifest.validate()
        with self._lock:
            self.check(manifest)
            if manifest.generation > self._generation:
                self._generation = manifest.generation
            own = self._owners.setdefault(manifest.owner, OwnerSlots())
            idx = own.writable(self._pinned)
            slot = own.slots[idx]
            slot.forget()
            slot.writing = manifest
            if self.files is not None:
                self.files.forget(manifest.owner, idx)
            buf = self._ensure_capacity(manifest.owner, idx, slot, held_bytes(manifest))
            return buf[: held_bytes(manifest)]

    def _writing(self, owner: int) -> tuple[int, Slot]:
        own = self._owners.get(owner)
        if own is not None:
            for i, s in enumerate(own.slots):
                if s.writing is not None:
                    return i, s
        raise MirrorError(f"no image of owner {owner} is being written")

    def bad_chunks(self, owner: int) -> list[int]:
        """Chunks of the image being written whose checksum does not match (yet)."""
        _, slot = self._writing(owner)
        m = slot.writing
        assert m is not None and slot.buffer is not None
        return bad_held_chunks(slot.buffer, m)

    def complete(self, owner: int, verified: bool = False) -> Manifest:
        """Mark the written slot complete; verifies checksums unless ``verified``.

        On a checksum failure the slot is discarded and :class:`IntegrityError`
        raised: the previous complete image stays the newest. The verdict is
        cached, so :meth:`verified_replicas` right after a round re-checks nothing.
        """
        with self._lock:
            idx, slot = self._writing(owner)
            m = slot.writing
            assert m is not None and slot.buffer is not None
            if not verified:
                bad = bad_held_chunks(slot.buffer, m)
                if bad:
                    slot.writing = None
                    raise IntegrityError(f"replica of owner {owner} v{m.version}: corrupt chunks {bad[:8]}")
            slot.writing = None
            slot.complete, slot.layout = m, None
            slot.verified(self._stat(owner, idx))
            if slot.in_file and self.files is not None:
                self.files.record(owner, idx, m)
            return m

    def abort(self, owner: int) -> None:
        """Forget a partially written image (the newest complete one is untouched)."""
        with self._lock:
            own = self._owners.get(owner)
            if own is not None:
                for s in own.slots:
                    s.writing = None

    def put(self, manifest: Manifest, buffer: torch.Tensor) -> Manifest:
        """Copy a whole image in (local use, repair from another holder, tests); same rules as begin/complete."""
        view = self.begin(manifest)
        view.copy_(buffer[held_from(manifest): manifest.total_bytes])
        return self.complete(manifest.owner)

    def take_copy(self, manifest: Manifest, held: torch.Tensor) -> Manifest:
        """Hold a verified copy found in the node-local tier (R11: a dead worker's own image or replica,
        ``held`` its bytes from :func:`held_from` on) like a replica this holder was sent.

        Why no ordering check (:meth:`check`): the copy is of the version the plan resumes at, from
        whichever generation captured it; this store may have seen a later generation meanwhile
        (a round of the generation that failed). Same slot rules otherwise: the newest complete
        image and the pinned version survive, a file-backed slot gets its manifest file. A copy of
        the same (generation, version) already held is kept as is.
        """
        manifest.validate()
        n = held_bytes(manifest)
        if held.numel() < n:
            raise IntegrityError(f"copy of owner {manifest.owner} v{manifest.version}: {held.numel()} bytes, "
                                 f"{n} wanted")
        with self._lock:
            own = self._owners.setdefault(manifest.owner, OwnerSlots())
            for s in own.slots:
                if s.complete is not None and image_key(s.complete) == image_key(manifest):
                    return s.complete
            idx = own.writable(self._pinned)
            slot = own.slots[idx]
            slot.forget()
            slot.writing = None
            if self.files is not None:
                self.files.forget(manifest.owner, idx)
            buf = self._ensure_capacity(manifest.owner, idx, slot, n)
            buf[:n].copy_(held[:n])
            slot.complete, slot.layout = manifest, None
            slot.verified(self._stat(manifest.owner, idx))
            if slot.in_file and self.files is not None:
                self.files.record(manifest.owner, idx, manifest)
            return manifest

    # --- read path ----------------------------------------------------------------
    def owners(self) -> list[int]:
        return sorted(o for o, own in self._owners.items() if own.newest() is not None)

    def latest(self, owner: int) -> StoredImage | None:
        with self._lock:
            own = self._owners.get(owner)
            idx = None if own is None else own.newest()
            if own is None or idx is None:
                return None
            s = own.slots[idx]
            assert s.complete is not None and s.buffer is not None
            return StoredImage(s.complete, s.buffer[: held_bytes(s.complete)])

    def _find(self, owner: int, version: int) -> tuple[int, Slot] | None:
        """Slot holding ``version`` of ``owner`` (newest generation first), as :meth:`get` sees it."""
        own = self._owners.get(owner)
        return None if own is None else own.find(version)

    def get(self, owner: int, version: int) -> StoredImage | None:
        """The complete image of ``owner`` at ``version`` (newest generation first), if held."""
        with self._lock:
            s = (self._find(owner, version) or (0, None))[1]
            if s is None or s.complete is None or s.buffer is None:
                return None
            return StoredImage(s.complete, s.buffer[: held_bytes(s.complete)])

    def layout_of(self, owner: int, version: int) -> str:
        """The layout key of the held ``(owner, version)`` ("" if not held), cached per slot."""
        with self._lock:
            s = (self._find(owner, version) or (0, None))[1]
            if s is None or s.complete is None:
                return ""
            if s.layout is None:
                s.layout = manifest_layout_key(s.complete)
            return s.layout

    def verified_copy(self, owner: int, version: int) -> Manifest | None:
        """Manifest of the held ``(owner, version)`` if its verdict stands (a partial round's kept pair).

        Trusts the cached verdict; re-checksums only when the payload file changed since.
        """
        if (owner, version) not in {(o, v) for o, v, _ in self._check({(owner, version)}, None).verified}:
            return None
        img = self.get(owner, version)
        return None if img is None else img.manifest

    def versions(self, owner: int) -> list[int]:
        own = self._owners.get(owner)
        if own is None:
            return []
        return sorted(s.complete.version for s in own.slots if s.complete is not None)

    def verify(self, owner: int, version: int | None = None) -> None:
        """Re-check one at-rest replica now (e.g. before serving it); raises IntegrityError."""
        img = self.latest(owner) if version is None else None
        version = img.manifest.version if img is not None else version
        res = None if version is None else self._check({(owner, version)}, 0.0)
        if res is None or not (res.verified or res.corrupt):
            raise MirrorError(f"no image of owner {owner} (version {version}) held")
        if res.corrupt:
            raise IntegrityError(f"held replica of owner {owner} v{version}: corrupt chunks {res.corrupt[0][2][:8]}")

    # --- at-rest verification -------------------------------------------------------
    def check_at_rest(self, max_age_s: float | None = None) -> AtRest:
        """Verify every complete replica; re-checksums only where the cached verdict may be stale.

        A verdict is stale when the payload file's stat changed (another
        process wrote it) or, with ``max_age_s``, when it is older than that
        (``0`` forces a full re-verify; in-memory rot shows up only that way).
        Corrupt replicas stay held until :meth:`drop`.
        """
        with self._lock:
            wanted = {(o, s.complete.version) for o, own in self._owners.items() for s in own.slots
                      if s.complete is not None}
        return self._check(wanted, max_age_s)

    def verified_replicas(self, max_age_s: float | None = None) -> list[tuple[int, int, int]]:
        """``(owner, version, n_chunks)`` of every complete replica whose checksums verify now.

        What a worker may report to the coordinator: the planner then never
        picks a holder whose copy is corrupt.
        """
        return self.check_at_rest(max_age_s).verified

    def _check(self, wanted: set[tuple[int, int]], max_age_s: float | None) -> AtRest:
        now = time.monotonic()
        todo: list[tuple[int, int, int, Slot, int, Manifest, torch.Tensor]] = []
        verified: list[tuple[int, int, int]] = []
        corrupt: list[tuple[int, int, list[int]]] = []
        with self._lock:
            for owner, version in sorted(wanted):
                hit = self._find(owner, version)
                if hit is None:
                    continue
                idx, s = hit
                assert s.complete is not None and s.buffer is not None
                if s.bad is not None:
                    corrupt.append((owner, version, list(s.bad)))
                elif (s.checked_at is None or (max_age_s is not None and now - s.checked_at >= max_age_s)
                      or s.stat != self._stat(owner, idx)):
                    todo.append((owner, version, idx, s, s.epoch, s.complete, s.buffer))
                else:
                    verified.append((owner, version, len(s.complete.chunk_checksums)))
        # Checksums outside the lock: a mirror round may proceed meanwhile; a slot
        # it rewrote (epoch changed) is simply not reported.
        for owner, version, idx, s, epoch, m, buf in todo:
            stat = self._stat(owner, idx)  # before reading: a later write changes it again
            bad = bad_held_chunks(buf, m)
            with self._lock:
                if s.epoch != epoch or s.complete is not m:
                    continue
                if bad:
                    s.bad, s.checked_at = bad, None
                    corrupt.append((owner, version, bad))
                else:
                    s.verified(stat)
                    verified.append((owner, version, len(m.chunk_checksums)))
        return AtRest(sorted(verified), sorted(corrupt))

    def drop(self, owner: int, version: int) -> bool:
        """Discard the held replica(s) of ``owner`` at ``version`` (e.g. found corrupt); True if any.

        The slot becomes empty and reusable; its manifest file goes, so a
        respawned holder does not re-attach it either.
        """
        with self._lock:
            own = self._owners.get(owner)
            dropped = False
            for i, s in enumerate(own.slots if own is not None else ()):
                if s.complete is not None and s.complete.version == version:
                    self._forget(owner, i, s)
                    dropped = True
            return dropped

    def _forget(self, owner: int, idx: int, slot: Slot) -> None:
        slot.forget()
        if self.files is not None:
            self.files.forget(owner, idx)

    def discard_newer(self, version: int) -> None:
        """After a rollback to ``version``: forget complete images newer than it."""
        with self._lock:
            for owner, own in self._owners.items():
                for i, s in enumerate(own.slots):
                    if s.complete is not None and s.complete.version > version:
                        self._forget(owner, i, s)

    @property
    def bytes_held(self) -> int:
        """Bytes of slot memory this store keeps (capacity, not just payload)."""
        return sum(s.capacity for own in self._owners.values() for s in own.slots)

    def slot_ptrs(self) -> list[int]:
        """data_ptr of every allocated slot (tests check buffers are reused)."""
        return [s.buffer.data_ptr() for _, own in sorted(self._owners.items()) for s in own.slots if s.buffer is not None]

    def close(self, unlink: bool = False) -> None:
        """Drop buffers; with ``unlink`` also delete this holder's shm files (job finished)."""
        with self._lock:
            self._owners.clear()
            if unlink and self.files is not None:
                self.files.unlink_all()

    # --- restart (:mod:`ckptless.mirror.reattach` fills a fresh store) ---------------------
    def adopt(self, owner: int, idx: int, buffer: torch.Tensor | None, manifest: Manifest | None,
              stat: tuple[int, int, int, int] | None) -> None:
        """Restart only: slot ``idx`` of ``owner`` maps its file (``buffer``) and holds ``manifest`` (verified).

        ``manifest`` None: an empty, reusable slot.
        """
        with self._lock:
            slot = self._owners.setdefault(owner, OwnerSlots()).slots[idx]
            slot.buffer, slot.in_file = buffer, buffer is not None
            if manifest is not None:
                slot.complete = manifest
                slot.verified(stat)
                self._generation = max(self._generation, manifest.generation)
