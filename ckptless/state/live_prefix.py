"""An image's replicated prefix read from the live tensors, not copied at capture (issue 21's memory).

Why: a rank of a replica set (DDP, HSDP's replicate dimension) must keep its own
copy of the replicated prefix of the *committed* version, because survivors that
stepped past it roll back to it and no peer holds it. With the classic capture it
also copies the *next* version's prefix into a second buffer while that version's
round runs: two copies of the prefix, 2 x S of host memory per rank.

The next version's prefix need not be copied to be checked: after the optimizer
step that produced version v + 1, the live parameters and optimizer state *are*
v + 1's prefix, and they stay so until the next optimizer step. So a deferred
capture copies only the private suffix; the mirror round checksums the prefix
straight from the live tensors (the same CRC32C per chunk that the copied bytes
would give, padding included) and compares it with the replicas'; once v + 1
commits, the engine copies the live prefix over the committed buffer (v's copy is
no longer needed), and the next optimizer step waits for that copy
(:meth:`ckptless.mirror.mirror.MirrorEngine.settle_prefix`). One copy of the
prefix: about 1 x S per rank.

What keeps it exact: every in-place write through autograd bumps a tensor's
version counter (for a DTensor, the DTensor's own), so the versions recorded at
capture tell whether the live bytes are still those of the captured version; a
changed one means the script writes parameters outside its optimizer step, and
the process goes back to the classic capture. Only CPU tensors are read live
(a device prefix would have to cross PCIe twice: docs/state.md says what would
take a GPU job's host copy to one). Pure data and local copies: no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import torch

from ckptless.state.checksum import chunk_bounds
from ckptless.state.manifest import TensorEntry


@dataclass(frozen=True)
class Piece:
    """One tensor of the prefix: where it lies in the image, the live tensor, and the tensor whose
    version counter an in-place write bumps (a DTensor for its local shard) with its version at capture."""

    entry: TensorEntry
    source: torch.Tensor
    watch: torch.Tensor
    version: int


def readable(t: torch.Tensor) -> bool:
    """Can this tensor's bytes be read where they live (a contiguous CPU tensor)?"""
    return t.device.type == "cpu" and t.is_contiguous()


@dataclass(frozen=True)
class LivePrefix:
    """The replicated prefix ``[0, nbytes)`` of one captured version, as the live tensors hold it."""

    nbytes: int
    pieces: tuple[Piece, ...]

    @classmethod
    def of(cls, nbytes: int, entries: Sequence[TensorEntry], tensors: Sequence[torch.Tensor],
           watch: dict[int, torch.Tensor] | None = None) -> LivePrefix:
        """The pieces of every tensor laid out below ``nbytes`` (``watch``: by data pointer, the tensor
        whose counter to read instead, :func:`ckptless.state.fence.late_sources`)."""
        watch = watch or {}
        pieces = []
        for e, t in zip(entries, tensors):
            if e.offset < nbytes and e.nbytes:
                w = watch.get(t.data_ptr(), t)
                pieces.append(Piece(e, t, w, w._version))
        return cls(nbytes, tuple(sorted(pieces, key=lambda p: p.entry.offset)))

    def changed(self) -> str | None:
        """Why the live tensors may no longer hold the captured bytes (None: they do)."""
        moved = [p for p in self.pieces if p.watch._version != p.version]
        if not moved:
            return None
        return (f"{len(moved)} replicated tensor(s) were written in place after their capture and before the "
                "next optimizer step (a parameter or optimizer state written outside the optimizer's step)")

    def _bytes_of(self, p: Piece) -> memoryview:
        flat = p.source.detach().reshape(-1).view(torch.uint8)
        return flat.numpy().data

    @functools.cached_property
    def _at(self) -> dict[int, Piece]:
        return {p.entry.offset: p for p in self.pieces}

    def bytes_at(self, offset: int) -> memoryview | None:
        """The live bytes of the prefix tensor laid out at ``offset`` (None: none is), read in place
        (the replica check's per-tensor digests, :mod:`ckptless.mirror.replica_check`). O(1) after one
        O(T) index (a scan per call made naming T differing tensors O(T^2))."""
        p = self._at.get(offset)
        return None if p is None else self._bytes_of(p)

    def checksums(self, chunk_bytes: int) -> list[int]:
        """CRC32C of every chunk of the prefix as a capture would lay it out (zero padding included),
        read from the live tensors without copying them (crc32c releases the GIL)."""
        sums: list[int] = []
        views = [(p.entry.offset, p.entry.offset + p.entry.nbytes, self._bytes_of(p)) for p in self.pieces]
        i = 0
        for start, n in chunk_bounds(self.nbytes, chunk_bytes):
            end, pos, crc = start + n, start, 0
            while i < len(views) and views[i][1] <= start:
                i += 1
            j = i
            while pos < end:
                if j < len(views) and views[j][0] < end:
                    lo, hi, mv = views[j]
                    if lo > pos:  # the zeroed gap before this tensor
                        crc = crc32c.crc32c(bytes(lo - pos), crc)
                        pos = lo
                    upto = min(hi, end)
                    crc = crc32c.crc32c(mv[pos - lo: upto - lo], crc)
                    pos = upto
                    if hi <= end:
                        j += 1
                    continue
                crc = crc32c.crc32c(bytes(end - pos), crc)  # padding to the next tensor or the chunk's end
                pos = end
            sums.append(int(crc))
        return sums

    def copy_into(self, out: torch.Tensor) -> None:
        """Lay the live prefix out into ``out[0:nbytes]`` (gaps zeroed), as a capture would have."""
        pos = 0
        for p in self.pieces:
            if p.entry.offset > pos:
                out[pos: p.entry.offset].zero_()
            e = p.entry  # its slot in the image (as state.image.slot, which imports this module's type)
            out[e.offset: e.offset + e.nbytes].view(p.source.dtype).view(e.shape).copy_(p.source)
            pos = p.entry.offset + p.entry.nbytes
        if pos < self.nbytes:
            out[pos: self.nbytes].zero_()


def deferrable(nbytes: int, entries: Sequence[TensorEntry], tensors: Sequence[torch.Tensor]) -> bool:
    """May this capture leave its prefix live? Only where every prefix tensor can be read in place."""
    return nbytes > 0 and all(readable(t) for e, t in zip(entries, tensors) if e.offset < nbytes and e.nbytes)


__all__ = ["LivePrefix", "Piece", "deferrable", "readable"]

