"""Capture the protected state into one flat checksummed buffer (restore: :mod:`ckptless.state.restore`).

Why one flat buffer: the mirror ships an image to peers as raw bytes over a
single collective (no per-tensor messages, no pickling), a peer can hold it
in preallocated memory, and per-chunk CRC32C lets any holder verify a stripe
on its own. Capture copies into a *reused* buffer because on this class of
machine a copy into preallocated memory runs at 3.5-4 GB/s while ``clone()``
into fresh pages manages 1.0-1.3 GB/s: after the first step, capture
allocates nothing large.

Layout: tensors in state-dict traversal order, each at a 64-byte aligned
offset (so every dtype can be viewed in place and copies stay vectorised);
padding bytes are zeroed so identical states give identical images.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import torch

from ckptless.errors import ConfigError, StateError
from ckptless.state import checksum, host_memory, streams
from ckptless.state.checksum import DEFAULT_CHUNK_BYTES
from ckptless.state.fence import CopyFence, late_sources
from ckptless.state.image import StateImage, check_buffer, slot
from ckptless.state.live_prefix import LivePrefix, deferrable
from ckptless.state.manifest import Manifest, TensorEntry, dtype_name
from ckptless.state.registry import StateRegistry
from ckptless.state.replication import EXTRA_KEY, Region, ReplicaSet, claim
from ckptless.state.restore import restore
from ckptless.state.tree import encode

ALIGN = 64

__all__ = ["ALIGN", "Capturer", "Plan", "StateImage", "restore"]  # restore and StateImage re-exported: older import paths


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _layout(tensors: list[torch.Tensor], shared: list[bool] | None = None,
            chunk_bytes: int = 1) -> tuple[list[TensorEntry], int, int]:
    """Entries in tensor order, the image's size and the end of its replicated prefix.

    The tensors flagged in ``shared`` are laid out first, in tensor order, and the prefix is padded to a
    whole chunk, so that replicas' prefixes are byte-identical chunk for chunk and a holder can keep the
    suffix alone (:mod:`ckptless.state.replication`); then every other tensor. Without shared tensors the
    layout is the plain one (prefix 0)."""
    entries: list[TensorEntry | None] = [None] * len(tensors)
    end = 0
    prefix = 0
    for want_shared in ((True, False) if shared is not None and any(shared) else (False,)):
        for i, t in enumerate(tensors):
            if shared is not None and any(shared) and shared[i] != want_shared:
                continue
            off = _align(end)
            nbytes = t.numel() * t.element_size()
            entries[i] = TensorEntry(dtype_name(t.dtype), tuple(t.shape), off, nbytes)
            end = off + nbytes
        if want_shared and shared is not None and any(shared):
            prefix = end = -(-end // chunk_bytes) * chunk_bytes
    out = [e for e in entries if e is not None]
    return out, end, prefix


@dataclass(frozen=True)
class Plan:
    """One capture's state and layout, collected once (``state_dict()`` of every protected object,
    the replica claim, the layout): :meth:`Capturer.plan` before a buffer is acquired, then
    :meth:`Capturer.capture` with it, so that a step collects its state once."""

    tree: Any
    tensors: list[torch.Tensor]
    ranks: ReplicaSet | None
    entries: list[TensorEntry]
    total: int
    prefix: int  # end of the replicated prefix (0: none)

    def can_defer(self, mirror_replicated: bool) -> bool:
        """May the capture leave the prefix live (:mod:`ckptless.state.live_prefix`)? Not when the
        prefix is mirrored (holders need its bytes), nor where a prefix tensor is not a contiguous
        CPU tensor."""
        return (self.ranks is not None and not mirror_replicated
                and deferrable(self.prefix, self.entries, self.tensors))

    def nbytes(self, defer: bool) -> int:
        """Bytes the capture buffer needs: the whole image, or its suffix alone when deferred."""
        return self.total - self.prefix if defer else self.total


Copy = tuple[int, torch.Tensor, torch.Tensor]  # (tensor index in the image, destination slot, source)


def copy_plan(pairs: list[Copy], late: Container[int]) -> dict[torch.device, tuple[list[Copy], list[Copy]]]:
    """The device-to-host copies of one capture, per *source* device (each gets its own side stream:
    a stream orders work on its own device only), each split into early and late copies (sources in
    ``late``: parameters and optimizer state, see :mod:`ckptless.state.fence`); image order kept."""
    by_device: dict[torch.device, tuple[list[Copy], list[Copy]]] = {}
    for item in pairs:
        src = item[2]
        early, late_items = by_device.setdefault(src.device, ([], []))
        (late_items if src.data_ptr() in late else early).append(item)
    return by_device


class Capturer:
    """Captures a :class:`StateRegistry` into :class:`StateImage` s.

    Typical use reuses one buffer (the first ``capture`` allocates it)::

        img = cap.capture(version=0, generation=g)
        img = cap.capture(version=1, generation=g, out=img.buffer)
    """

    def __init__(self, registry: StateRegistry, job_id: str, owner: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout_s: float = 60.0, mirror_replicated: bool = False) -> None:
        if not isinstance(job_id, str) or not job_id:
            raise ConfigError("job_id", job_id, "must be a non-empty string")
        if type(owner) is not int or owner < 0:
            raise ConfigError("owner", owner, "must be a non-negative int (the owning rank)")
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ConfigError("chunk_bytes", chunk_bytes, "must be a positive int")
        self.registry = registry
        self.job_id = job_id
        self.owner = owner
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.mirror_replicated = mirror_replicated

    def _collect(self) -> tuple[Any, list[torch.Tensor], list[bool] | None, ReplicaSet | None]:
        """The state tree, its tensors, which of them are replicated (None: none) and over which ranks."""
        states: dict[str, Any] = {}
        for name, obj in self.registry.items():
            try:
                states[name] = obj.state_dict()
            except StateError:
                raise
            except Exception as exc:
                raise StateError(f"{name}.state_dict() failed: {exc}") from exc
        tree, tensors = encode(states)
        declared: dict[str, ReplicaSet] = getattr(self.registry, "replicated", dict)()
        ranks, ptrs = claim(self.registry.items(), states, declared, self.owner)
        if ranks is None or not ptrs:
            return tree, tensors, None, None
        shared = [bool(t.numel()) and (t.device.type, t.data_ptr()) in ptrs for t in tensors]
        if not any(shared):
            return tree, tensors, None, None
        return tree, tensors, shared, ranks

    def plan(self) -> Plan:
        """The current state and its layout (state sizes may grow, e.g. optimizer moments appear after
        the first step: plan every capture anew)."""
        tree, tensors, shared, ranks = self._collect()
        entries, total, prefix = _layout(tensors, shared, self.chunk_bytes)
        return Plan(tree, tensors, ranks, entries, total, prefix)

    def required_bytes(self) -> int:
        """Bytes an image of the current state needs."""
        return self.plan().total

    def allocate(self, nbytes: int | None = None) -> torch.Tensor:
        """A buffer for :meth:`capture`: page-locked when this process uses CUDA, so that the
        device-to-host copies run asynchronously (:mod:`ckptless.state.host_memory`)."""
        n = self.required_bytes() if nbytes is None else nbytes
        return host_memory.empty(n)

    def capture(self, version: int, generation: int, out: torch.Tensor | None = None,
                checksum_now: bool = True, plan: Plan | None = None, defer_prefix: bool = False) -> StateImage:
        """Copy the current state into ``out`` (allocated when None) and checksum it.

        ``checksum_now=False``: the manifest's ``chunk_checksums`` is left empty
        for the mirror engine to fill on its background thread (see
        :meth:`ckptless.mirror.mirror.MirrorEngine.submit`), and device tensors
        are copied asynchronously: the image's ``fence`` (:mod:`ckptless.state.fence`)
        says when the bytes are final, and the training thread waits for
        nothing. Such an image is not valid until the engine waited for the
        fence and checksummed it. ``checksum_now=True`` waits for the copies
        (with a deadline) and checksums here.

        ``plan``: from :meth:`plan` (collected now when None). ``defer_prefix``: copy the private
        suffix alone, ``out[0:total - prefix]`` holding image bytes ``[prefix, total)``; the image's
        ``live`` reads the prefix from the live tensors (:mod:`ckptless.state.live_prefix`;
        :meth:`Plan.can_defer` must hold, and then ``checksum_now`` must be False).

        Raises :class:`StateError` when ``out`` is too small (with both sizes)
        or when some state cannot be represented.
        """
        if type(version) is not int or version < 0:
            raise ConfigError("version", version, "must be a non-negative int")
        if type(generation) is not int or generation < 0:
            raise ConfigError("generation", generation, "must be a non-negative int")
        p = self.plan() if plan is None else plan
        tree, tensors, ranks, entries, total, prefix = p.tree, p.tensors, p.ranks, p.entries, p.total, p.prefix
        region = None if ranks is None else Region(prefix, ranks, self.mirror_replicated)
        if defer_prefix and (checksum_now or not p.can_defer(self.mirror_replicated)):
            raise StateError("a capture may leave its prefix live only unchecksummed, with a readable, unmirrored prefix")
        base = prefix if defer_prefix else 0
        if out is None:
            out = self.allocate(total - base)
        check_buffer(out, "capture buffer")
        if out.numel() < total - base:
            raise StateError(f"capture buffer too small: state needs {total - base} bytes, buffer has {out.numel()}")
        live = LivePrefix.of(prefix, entries, tensors, self._watch()) if defer_prefix else None
        fence = self._copy(out, tensors, entries, base)
        if fence is not None and checksum_now:
            fence.wait(self.timeout_s, f"capture of version {version}")
            if fence.seal() is not None:
                raise StateError(f"capture of version {version} is torn: {fence.torn}")
            fence = None
        sums = checksum.chunk_checksums(out, self.chunk_bytes, total) if checksum_now else []
        manifest = Manifest(
            job_id=self.job_id,
            owner=self.owner,
            version=version,
            generation=generation,
            total_bytes=total,
            chunk_bytes=self.chunk_bytes,
            chunk_checksums=tuple(sums),
            tensors=tuple(entries),
            tree=tree,
            extra={} if region is None else {EXTRA_KEY: region.to_json()},
        )
        return StateImage(manifest=manifest, buffer=out, fence=fence, live=live)

    def _watch(self) -> dict[int, torch.Tensor]:
        return late_sources(obj for _, obj in self.registry.items())

    def _copy(self, out: torch.Tensor, tensors: list[torch.Tensor], entries: list[TensorEntry],
              base: int = 0) -> CopyFence | None:
        """CPU tensors are copied here; device tensors are queued on side streams (returns their fence).
        ``base``: ``out`` holds the image from that byte on (a deferred prefix); tensors below it are skipped."""
        end = base
        for e in sorted(entries, key=lambda x: x.offset):  # the gaps, zeroed: equal states, equal images
            if e.offset < base:
                continue
            if e.offset > end:
                out[end - base : e.offset - base].zero_()
            end = max(end, e.offset + e.nbytes)
        on_device: list[Copy] = []
        for i, (t, e) in enumerate(zip(tensors, entries)):
            if e.offset < base:
                continue
            dst = slot(out, dataclasses.replace(e, offset=e.offset - base) if base else e, t.dtype)
            if t.device.type == "cpu":
                dst.copy_(t)
            else:
                on_device.append((i, dst, t))
        if not on_device:
            return None
        return self._copy_from_device(on_device, self._watch())

    def _copy_from_device(self, pairs: list[Copy], late: dict[int, torch.Tensor]) -> CopyFence:
        """Device-to-host copies on one side stream per source device; returns their fence.

        Each side stream first waits for its device's current stream (it reads
        finished values), copies the early tensors, marks, copies the late ones
        (parameters, optimizer state) and marks again. ``record_stream`` keeps a
        source that the script frees meanwhile from being reused under the
        copy. Nothing here waits: see :mod:`ckptless.state.fence` for who does.
        Into page-locked memory the copies are asynchronous; into pageable
        memory CUDA performs them before returning (correct, only slower).
        """
        if not torch.cuda.is_available():
            raise StateError(f"tensor on {pairs[0][2].device} but CUDA is not available")
        by_device = copy_plan(pairs, late)
        early_marks: list[streams.Marker] = []
        late_marks: list[streams.Marker] = []
        watched: list[tuple[int, torch.Tensor, int]] = []
        for device, (early, late_items) in by_device.items():
            side = streams.side_stream(device)
            with torch.cuda.device(device):
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _, dst, src in early:
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(side)
                    early_marks.append(streams.EventMarker(device, side))
                    for i, dst, src in late_items:
                        watch = late.get(src.data_ptr(), src)  # a DTensor's own counter, not its shard's
                        watched.append((i, watch, watch._version))
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(side)
                    late_marks.append(streams.EventMarker(device, side))
        return CopyFence(early_marks, late_marks, watched)
