"""The agent's table of local worker slots: which worker runs in which slot, for which rank.

Why a table of its own: after recoveries a slot's worker id and rank change
(a respawn mints a new worker id; a spare adopts a lost rank), and the exit
reaper, the membership follower and the hang detector read it from different
threads. All access goes through one lock, which is also why the table keeps
which GPU each slot uses and which GPUs failed: choosing a free GPU and taking
it must be one step, or a respawn and a spare refill could take the same one
(the rules are ``launcher/devices.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ckptless.launcher.devices import choose_gpu


@dataclass
class Slot:
    local_rank: int
    worker_id: str
    rank: int | None  # None: a spare not yet assigned (or a dropped worker)
    heartbeat_file: str
    alive: bool = True
    succeeded: bool = False
    failed: bool = False
    spare: bool = False  # started without a rank, waiting to be assigned one
    ever_ranked: bool = False
    last_rank: int | None = None  # the rank it ran before it was unassigned (where that rank respawns)
    device: int | None = None  # the GPU its worker uses (None: a CPU job, or past the node's GPUs)


def slot_for_rank(slots: Sequence[Slot], rank: int, rank_offset: int) -> Slot | None:
    """Where ``rank`` respawns among ``slots`` (the rule of :meth:`SlotTable.for_rank_slot`, pure: the node
    machine applies it to the table as its own step leaves it)."""
    for s in slots:
        if s.rank == rank:
            return s
    unassigned = [s for s in slots if s.rank is None and not (s.spare and s.alive)]
    for s in unassigned:
        if s.last_rank == rank:
            return s
    by_local = {s.local_rank: s for s in slots}
    s2 = by_local.get(rank - rank_offset)
    if s2 is not None and s2.rank is None:
        return s2
    dead = [s for s in unassigned if not s.alive]
    return dead[0] if dead else None


class SlotTable:
    def __init__(self, gpus: int = 0) -> None:
        self._slots: dict[int, Slot] = {}
        self._lock = threading.Lock()
        self.gpus = gpus  # the GPUs this node offers (0: a CPU job; launcher/devices.py)
        self._bad: set[int] = set()  # GPUs a worker failed on with a GPU-class error: never used again

    def add(self, slot: Slot) -> None:
        with self._lock:
            slot.spare = slot.rank is None
            slot.ever_ranked = slot.rank is not None
            self._slots[slot.local_rank] = slot

    def get(self, local_rank: int) -> Slot:
        with self._lock:
            s = self._slots[local_rank]
            return Slot(**vars(s))

    def all(self) -> list[Slot]:
        with self._lock:
            return [Slot(**vars(s)) for s in self._slots.values()]

    def exited(self, local_rank: int, ok: bool) -> None:
        with self._lock:
            s = self._slots[local_rank]
            s.alive, s.succeeded, s.failed = False, ok, not ok

    def assign(self, local_rank: int, rank: int | None) -> None:
        with self._lock:
            s = self._slots[local_rank]
            if rank is None and s.rank is not None:
                s.last_rank = s.rank
            s.rank = rank
            if rank is not None:
                s.spare, s.ever_ranked = False, True

    def reset(self, local_rank: int, worker_id: str, rank: int) -> None:
        """A new incarnation in this slot (a respawn)."""
        with self._lock:
            s = self._slots[local_rank]
            s.worker_id, s.rank, s.alive, s.succeeded, s.failed = worker_id, rank, True, False, False
            s.spare, s.ever_ranked = False, True

    def for_rank_slot(self, rank: int, rank_offset: int) -> Slot | None:
        """Where ``rank`` respawns here: the slot holding it, else an unassigned slot that last ran
        it, else its local index if that slot runs no other rank, else any unassigned dead slot.

        Why not simply the local index: a rank that a warm spare adopted runs in the spare's
        slot; once that slot is unassigned, the local index may run another rank (which the
        respawn must never wait on or replace).
        """
        with self._lock:
            found = slot_for_rank(list(self._slots.values()), rank, rank_offset)
            return None if found is None else Slot(**vars(found))

    # --- GPUs (launcher/devices.py has the rules) ---------------------------------------------------
    def _used(self, but: int | None = None) -> set[int]:
        """GPUs taken: by live workers, and by dead ones whose rank no membership has moved yet (their
        exit is being handled: a respawn may start there, and two failures at once must not both count
        one free GPU). Once a membership unassigns a dead slot, its GPU is free (e.g. for a refill)."""
        return {s.device for s in self._slots.values()
                if (s.alive or s.rank is not None) and s.device is not None and s.local_rank != but}

    def bad_gpus(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._bad)

    def claim_device(self, local_rank: int) -> tuple[bool, int | None]:
        """The GPU a new incarnation in this slot uses: its own unless bad or taken by a live worker,
        else the lowest free good one. ``(False, None)``: the node has GPUs and none is left for it;
        ``(True, None)``: a CPU job (or a member past the node's GPUs), nothing to choose."""
        with self._lock:
            s = self._slots[local_rank]
            if self.gpus == 0 or s.device is None:  # a CPU job, or an oversubscribed node's extra rank
                return True, s.device
            gpu = choose_gpu(self.gpus, self._used(but=local_rank), self._bad, keep=s.device)
            if gpu is None:
                return False, None
            s.device = gpu
            return True, gpu

    def device_failed(self, local_rank: int) -> tuple[int | None, bool]:
        """This slot's worker exited with a GPU-class error: its GPU is marked bad for good, and the
        slot takes another free good GPU now (so two failures do not count the same free GPU twice).
        Returns (the GPU marked bad, whether the slot can start its rank again here). A slot without
        a GPU of ours cannot: moving it off the failed device is not ours to do, and a respawn there
        would meet the same device again."""
        with self._lock:
            s = self._slots[local_rank]
            bad = s.device
            if bad is None:
                return None, False
            self._bad.add(bad)
            gpu = choose_gpu(self.gpus, self._used(but=local_rank), self._bad)
            if gpu is not None:
                s.device = gpu
            return bad, gpu is not None

    def gpu_free(self) -> bool:
        """A new spare would find a GPU (always, in a CPU job)."""
        with self._lock:
            return self.gpus == 0 or choose_gpu(self.gpus, self._used(), self._bad) is not None

    def add_with_device(self, slot: Slot) -> bool:
        """Add a new spare's slot on the lowest free good GPU; False (nothing added): none is free."""
        with self._lock:
            if self.gpus > 0:
                gpu = choose_gpu(self.gpus, self._used(), self._bad)
                if gpu is None:
                    return False
                slot.device = gpu
            slot.spare = slot.rank is None
            slot.ever_ranked = slot.rank is not None
            self._slots[slot.local_rank] = slot
            return True

    def ever_ranked(self) -> bool:
        """Some slot of this node held a rank at some point (a spare-only node: never)."""
        with self._lock:
            return any(s.ever_ranked for s in self._slots.values())

    def all_assigned_succeeded(self) -> bool:
        """No slot runs a rank any more, and every slot that had one ended well."""
        with self._lock:
            ranked = [s for s in self._slots.values() if s.rank is not None]
            return all(not s.alive and s.succeeded for s in ranked)

    def failed_ranks(self) -> list[int]:
        with self._lock:
            return sorted(s.rank for s in self._slots.values() if s.rank is not None and s.failed)
