"""Peer store: the images this rank holds for other ranks, double-buffered.

Why two slots per owner: while version v+1 is being received, the newest
complete version must stay intact (it may be the committed one recovery needs).
So each owner has exactly two slots: the newest complete image and the one
being written. Slots are reused for every version (no allocation once sizes are
stable: fresh memory costs page faults at ~1 GB/s, reuse runs at ~4 GB/s).

Why optional ``/dev/shm`` backing: a file-backed tensor survives the holder's
own process crash, so a respawned holder re-attaches its replicas instead of
losing them. The payload is written first; the manifest JSON beside it is
written (atomically) only after the payload verified, and removed before a
slot is rewritten, so a crash mid-write never leaves a manifest that lies.

Ordering: images are ordered by ``(generation, version)``; an image not newer
than the newest complete one is rejected (:class:`StaleVersion`), as is one
from another job or an older generation (:class:`StaleGeneration`).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ckptless.errors import IntegrityError, ManifestError, MirrorError, StaleGeneration
from ckptless.state.checksum import bad_chunks
from ckptless.state.manifest import Manifest


class Image(Protocol):
    """Structural twin of ``ckptless.state.capture.StateImage``."""

    manifest: Manifest
    buffer: torch.Tensor


@dataclass
class StoredImage:
    """A complete image held by the store; ``buffer`` is a view into a slot (do not write)."""

    manifest: Manifest
    buffer: torch.Tensor


class StaleVersion(StaleGeneration, MirrorError):
    """An image is not newer than the one already held for its owner."""


def _key(m: Manifest) -> tuple[int, int]:
    return (m.generation, m.version)


def file_prefix(job_id: str) -> str:
    """Stable, filesystem-safe prefix for a job's files (sanitised name + hash)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:40]
    digest = hashlib.blake2b(job_id.encode(), digest_size=4).hexdigest()
    return f"ckptless-{safe}-{digest}"


_NAME = re.compile(r"-o(\d+)-s([01])\.bin$")


@dataclass
class _Slot:
    buffer: torch.Tensor | None = None
    complete: Manifest | None = None
    writing: Manifest | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


@dataclass
class _Owner:
    slots: tuple[_Slot, _Slot] = field(default_factory=lambda: (_Slot(), _Slot()))

    def newest(self) -> int | None:
        done = [i for i, s in enumerate(self.slots) if s.complete is not None]
        if not done:
            return None
        return max(done, key=lambda i: _key(self.slots[i].complete))  # type: ignore[arg-type]


class PeerStore:
    """Holds other ranks' images; thread-safe for one writer plus readers."""

    def __init__(self, job_id: str, generation: int = 0, shm_dir: str | None = None) -> None:
        self.job_id = job_id
        self._generation = generation
        self.shm_dir = shm_dir
        self._owners: dict[int, _Owner] = {}
        self._lock = threading.Lock()
        self.rejected: list[tuple[str, str]] = []  # (path, reason) from attach()
        self._pinned: int | None = None
        if shm_dir is not None:
            os.makedirs(shm_dir, exist_ok=True)

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

    # --- paths ------------------------------------------------------------------
    def _path(self, owner: int, slot: int, ext: str) -> str:
        assert self.shm_dir is not None
        return os.path.join(self.shm_dir, f"{file_prefix(self.job_id)}-o{owner}-s{slot}.{ext}")

    def _ensure_capacity(self, owner: int, idx: int, slot: _Slot, nbytes: int) -> torch.Tensor:
        nbytes = max(nbytes, 1)  # zero-length mappings are not allowed
        if slot.buffer is not None and slot.capacity >= nbytes:
            return slot.buffer
        slot.buffer = None  # drop the old mapping before growing
        if self.shm_dir is None:
            slot.buffer = torch.empty(nbytes, dtype=torch.uint8)
        else:
            path = self._path(owner, idx, "bin")
            # Grow with truncate first: torch.from_file growing a file itself clobbers byte 0.
            with open(path, "ab"):
                pass
            os.truncate(path, nbytes)
            slot.buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return slot.buffer

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
                if _key(manifest) <= _key(held):
                    raise StaleVersion(
                        f"owner {manifest.owner}: (gen, version) {_key(manifest)} is not newer than held {_key(held)}"
                    )

    def begin(self, manifest: Manifest) -> torch.Tensor:
        """Reserve the writing slot for ``manifest``; returns the view to fill (total_bytes long).

        The slot that does not hold the newest complete image is reused; whatever
        older image it held is forgotten now.
        """
        manifest.validate()
        with self._lock:
            self.check(manifest)
            if manifest.generation > self._generation:
                self._generation = manifest.generation
            own = self._owners.setdefault(manifest.owner, _Owner())
            idx = self._writable(own)
            slot = own.slots[idx]
            slot.complete = None
            slot.writing = manifest
            if self.shm_dir is not None:
                try:
                    os.unlink(self._path(manifest.owner, idx, "json"))
                except FileNotFoundError:
                    pass
            buf = self._ensure_capacity(manifest.owner, idx, slot, manifest.total_bytes)
            return buf[: manifest.total_bytes]

    def _writable(self, own: _Owner) -> int:
        """An empty slot, else the older unpinned one; the pinned image always survives."""
        def rank(i: int) -> tuple[int, int, int]:
            m = own.slots[i].complete
            if m is None:
                return (0, 0, 0)
            if m.version == self._pinned:
                return (2, 0, 0)
            return (1, *_key(m))
        return min((0, 1), key=rank)

    def _writing(self, owner: int) -> tuple[int, _Slot]:
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
        return bad_chunks(slot.buffer, m.chunk_bytes, list(m.chunk_checksums), m.total_bytes)

    def complete(self, owner: int, verified: bool = False) -> Manifest:
        """Mark the written slot complete; verifies checksums unless ``verified``.

        On a checksum failure the slot is discarded and :class:`IntegrityError`
        raised: the previous complete image stays the newest.
        """
        with self._lock:
            idx, slot = self._writing(owner)
            m = slot.writing
            assert m is not None and slot.buffer is not None
            if not verified:
                bad = bad_chunks(slot.buffer, m.chunk_bytes, list(m.chunk_checksums), m.total_bytes)
                if bad:
                    slot.writing = None
                    raise IntegrityError(f"replica of owner {owner} v{m.version}: corrupt chunks {bad[:8]}")
            slot.writing = None
            slot.complete = m
            if self.shm_dir is not None:
                path = self._path(owner, idx, "json")
                tmp = path + ".tmp"
                with open(tmp, "wb") as f:
                    f.write(m.to_bytes())
                os.replace(tmp, path)
            return m

    def abort(self, owner: int) -> None:
        """Forget a partially written image (the newest complete one is untouched)."""
        with self._lock:
            own = self._owners.get(owner)
            if own is not None:
                for s in own.slots:
                    s.writing = None

    def put(self, manifest: Manifest, buffer: torch.Tensor) -> Manifest:
        """Copy a whole image in (local use and tests); same rules as begin/complete."""
        view = self.begin(manifest)
        view.copy_(buffer[: manifest.total_bytes])
        return self.complete(manifest.owner)

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
            return StoredImage(s.complete, s.buffer[: s.complete.total_bytes])

    def get(self, owner: int, version: int) -> StoredImage | None:
        """The complete image of ``owner`` at ``version`` (newest generation first), if held."""
        with self._lock:
            own = self._owners.get(owner)
            if own is None:
                return None
            hits = [s for s in own.slots if s.complete is not None and s.complete.version == version]
            if not hits:
                return None
            s = max(hits, key=lambda s: _key(s.complete))  # type: ignore[arg-type]
            assert s.complete is not None and s.buffer is not None
            return StoredImage(s.complete, s.buffer[: s.complete.total_bytes])

    def versions(self, owner: int) -> list[int]:
        own = self._owners.get(owner)
        if own is None:
            return []
        return sorted(s.complete.version for s in own.slots if s.complete is not None)

    def verify(self, owner: int, version: int | None = None) -> None:
        """Re-check an at-rest replica (e.g. before serving it to a replacement)."""
        img = self.latest(owner) if version is None else self.get(owner, version)
        if img is None:
            raise MirrorError(f"no image of owner {owner} (version {version}) held")
        m = img.manifest
        bad = bad_chunks(img.buffer, m.chunk_bytes, list(m.chunk_checksums), m.total_bytes)
        if bad:
            raise IntegrityError(f"held replica of owner {owner} v{m.version}: corrupt chunks {bad[:8]}")

    def discard_newer(self, version: int) -> None:
        """After a rollback to ``version``: forget complete images newer than it."""
        with self._lock:
            for owner, own in self._owners.items():
                for i, s in enumerate(own.slots):
                    if s.complete is not None and s.complete.version > version:
                        s.complete = None
                        if self.shm_dir is not None:
                            try:
                                os.unlink(self._path(owner, i, "json"))
                            except FileNotFoundError:
                                pass

    @property
    def bytes_held(self) -> int:
        """Bytes of slot memory this store keeps (capacity, not just payload)."""
        return sum(s.capacity for own in self._owners.values() for s in own.slots)

    def slot_ptrs(self) -> list[int]:
        """data_ptr of every allocated slot (tests check buffers are reused)."""
        return [s.buffer.data_ptr() for _, own in sorted(self._owners.items()) for s in own.slots if s.buffer is not None]

    def close(self, unlink: bool = False) -> None:
        """Drop buffers; with ``unlink`` also delete the shm files (job finished)."""
        with self._lock:
            if unlink and self.shm_dir is not None:
                for owner in self._owners:
                    for i in (0, 1):
                        for ext in ("bin", "json"):
                            try:
                                os.unlink(self._path(owner, i, ext))
                            except FileNotFoundError:
                                pass
            self._owners.clear()

    # --- restart ----------------------------------------------------------------------
    @classmethod
    def attach(cls, shm_dir: str, job_id: str) -> PeerStore:
        """Re-open the replicas a previous incarnation of this holder left in ``shm_dir``.

        Only slots with a manifest (written after their payload completed) whose
        checksums verify are kept; the rest are listed in ``store.rejected``.
        """
        store = cls(job_id, 0, shm_dir)
        prefix = file_prefix(job_id)
        for name in sorted(os.listdir(shm_dir)):
            match = _NAME.search(name)
            if not name.startswith(prefix + "-o") or match is None:
                continue
            owner, idx = int(match.group(1)), int(match.group(2))
            path = os.path.join(shm_dir, name)
            own = store._owners.setdefault(owner, _Owner())
            slot = own.slots[idx]
            size = os.path.getsize(path)
            if size > 0:
                slot.buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            mpath = path[: -len(".bin")] + ".json"
            if not os.path.exists(mpath):
                continue  # payload never completed: an empty, reusable slot
            try:
                with open(mpath, "rb") as f:
                    m = Manifest.from_bytes(f.read())
                if m.job_id != job_id or m.owner != owner:
                    raise ManifestError(f"manifest names job {m.job_id!r} owner {m.owner}")
                if m.total_bytes > size or slot.buffer is None and m.total_bytes:
                    raise ManifestError(f"payload file holds {size} bytes, manifest wants {m.total_bytes}")
                if m.total_bytes and bad_chunks(slot.buffer, m.chunk_bytes, list(m.chunk_checksums), m.total_bytes):  # type: ignore[arg-type]
                    raise IntegrityError("checksum mismatch")
            except (ManifestError, IntegrityError, OSError) as exc:
                store.rejected.append((path, str(exc)))
                continue
            slot.complete = m
            store._generation = max(store._generation, m.generation)
        return store
