"""One owner's double buffer in a peer store: two slots, which one is newest, which one may be written.

Why two slots per owner: while version v+1 is being received, the newest
complete version must stay intact (it may be the committed one recovery needs).
So each owner has exactly two slots: the newest complete image and the one
being written. Slots are reused for every version (no allocation once sizes are
stable: fresh memory costs page faults at ~1 GB/s, reuse runs at ~4 GB/s).

Why a module of its own: these are plain records with the double-buffer
rules on them (newest by ``(generation, version)``, the pinned image never
overwritten) and nothing else: no lock, no files, no checksums. The store
(:mod:`ckptless.mirror.store`) holds them under its lock and decides what
to put in them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ckptless.state import Manifest


def image_key(m: Manifest) -> tuple[int, int]:
    """How held images are ordered: ``(generation, version)``."""
    return (m.generation, m.version)


@dataclass
class Slot:
    """One buffer of an owner's double buffer and what it holds."""

    buffer: torch.Tensor | None = None
    complete: Manifest | None = None
    writing: Manifest | None = None
    # Verdict on ``complete``: when it last verified, the payload file's stat
    # then, or the chunks found corrupt. ``epoch`` changes whenever the slot's
    # content is replaced, so a check that raced with a rewrite is not recorded.
    checked_at: float | None = None
    stat: tuple[int, int, int, int] | None = None
    bad: list[int] | None = None
    epoch: int = 0
    layout: str | None = None  # ``complete``'s layout key, computed on first ask
    in_file: bool = False  # ``buffer`` maps its shm file (else: memory, and no manifest file is written)

    def forget(self) -> None:
        self.complete = None
        self.layout = None
        self.checked_at, self.stat, self.bad = None, None, None
        self.epoch += 1

    def verified(self, stat: tuple[int, int, int, int] | None) -> None:
        self.checked_at, self.stat, self.bad = time.monotonic(), stat, None

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


@dataclass
class OwnerSlots:
    """The two slots a holder keeps for one owner."""

    slots: tuple[Slot, Slot] = field(default_factory=lambda: (Slot(), Slot()))

    def newest(self) -> int | None:
        done = [i for i, s in enumerate(self.slots) if s.complete is not None]
        if not done:
            return None
        return max(done, key=lambda i: image_key(self.slots[i].complete))  # type: ignore[arg-type]

    def writable(self, pinned: int | None) -> int:
        """An empty slot, else the older unpinned one; the ``pinned`` version's image always survives."""
        def rank(i: int) -> tuple[int, int, int]:
            m = self.slots[i].complete
            if m is None:
                return (0, 0, 0)
            if m.version == pinned:
                return (2, 0, 0)
            return (1, *image_key(m))
        return min((0, 1), key=rank)

    def find(self, version: int) -> tuple[int, Slot] | None:
        """The slot holding ``version`` complete (newest generation first)."""
        hits = [(i, s) for i, s in enumerate(self.slots) if s.complete is not None and s.complete.version == version]
        return max(hits, key=lambda h: image_key(h[1].complete), default=None)  # type: ignore[arg-type]
