"""The agent's table of local worker slots: which worker runs in which slot, for which rank.

Why a table of its own: after recoveries a slot's worker id and rank change
(a respawn mints a new worker id; a spare adopts a lost rank), and the exit
reaper, the membership follower and the hang detector read it from different
threads. All access goes through one lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


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


class SlotTable:
    def __init__(self) -> None:
        self._slots: dict[int, Slot] = {}
        self._lock = threading.Lock()

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
            slots = list(self._slots.values())
            for s in slots:
                if s.rank == rank:
                    return Slot(**vars(s))
            unassigned = [s for s in slots if s.rank is None and not (s.spare and s.alive)]
            for s in unassigned:
                if s.last_rank == rank:
                    return Slot(**vars(s))
            s2 = self._slots.get(rank - rank_offset)
            if s2 is not None and s2.rank is None:
                return Slot(**vars(s2))
            dead = [s for s in unassigned if not s.alive]
            return Slot(**vars(dead[0])) if dead else None

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
