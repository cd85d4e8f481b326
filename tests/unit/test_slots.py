"""SlotTable.for_rank_slot: where a lost rank is respawned on this node (pure, no processes)."""

from __future__ import annotations

from ckptless.launcher.slots import Slot, SlotTable


def _table(n_workers: int, n_spares: int) -> SlotTable:
    t = SlotTable()
    for lr in range(n_workers + n_spares):
        t.add(Slot(lr, f"n/w{lr}", lr if lr < n_workers else None, f"hb{lr}"))
    return t


def test_a_rank_respawns_in_its_own_slot() -> None:
    t = _table(2, 0)
    t.exited(1, ok=False)
    t.assign(1, None)  # the membership gave rank 1 to a respawn
    s = t.for_rank_slot(1, 0)
    assert s is not None and s.local_rank == 1


def test_a_rank_adopted_by_a_spare_respawns_in_the_spare_slot_not_its_local_index() -> None:
    """Rank 0 went to the spare in slot 3; slot 0 was re-used (re-exec) as rank 1. Rank 0's next
    loss must respawn in slot 3 (dead, last ran rank 0), never in slot 0 (alive, rank 1)."""
    t = _table(2, 2)
    t.exited(0, ok=False)
    t.assign(0, None)
    t.assign(3, 0)  # the spare in slot 3 took rank 0
    t.reset(0, "n/spare-reexec", 1)  # slot 0 now runs rank 1
    t.exited(3, ok=False)
    t.assign(3, None)
    s = t.for_rank_slot(0, 0)
    assert s is not None and s.local_rank == 3


def test_the_holder_is_found_before_it_is_unassigned() -> None:
    t = _table(2, 1)
    t.exited(1, ok=False)
    t.assign(1, None)
    t.assign(2, 1)  # the spare in slot 2 took rank 1
    s = t.for_rank_slot(1, 0)
    assert s is not None and s.local_rank == 2  # the spare slot holds rank 1 now


def test_never_a_live_spare_or_a_slot_running_another_rank() -> None:
    t = _table(2, 1)  # slot 2: a live idle spare
    t.exited(0, ok=False)
    t.assign(0, None)
    t.reset(0, "n/x", 1)  # slot 0 runs rank 1 again (contrived) and slot 1 runs rank 1 too
    assert t.for_rank_slot(0, 0) is None  # nowhere safe: no respawn rather than a wrong one
