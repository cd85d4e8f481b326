"""When a node agent's part in the job is over (launcher/completion.py, node_part): pure, no processes.

Issue 35 finding 8: an agent paused past --node-grace came back, the coordinator moved its ranks to
respawns on the same node (new worker ids), the follower unassigned the old slots, and before the
respawn thread had started them the main loop read "no slot holds a rank" as "all our ranks
finished": the agent exited 0 (the respawn then refused, "group is stopping") and the job failed
"no replacement within 30s". The node's part is judged against the membership it follows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.launcher.completion import node_part
from ckptless.launcher.slots import Slot, SlotTable


def _table(n_workers: int, n_spares: int = 0) -> SlotTable:
    t = SlotTable()
    for lr in range(n_workers + n_spares):
        t.add(Slot(lr, f"n/w{lr}", lr if lr < n_workers else None, f"hb{lr}"))
    return t


MINE = {0: "n/w0", 1: "n/w1"}


def test_running_while_a_rank_runs() -> None:
    assert node_part(_table(2).all(), MINE) == "running"


def test_finished_when_every_rank_placed_here_ended_well() -> None:
    t = _table(2)
    t.exited(0, ok=True)
    t.exited(1, ok=True)
    assert node_part(t.all(), MINE) == "finished"


def test_a_respawn_placed_here_but_not_started_yet_is_not_finished() -> None:
    """The regression: the follower unassigned both slots (their workers are not in generation 1) and
    the respawns of ranks 0 and 1 (new worker ids, this node) have not been started yet."""
    t = _table(2)
    for lr in (0, 1):
        t.exited(lr, ok=False)  # SIGKILLed by the follower: not part of generation 1
        t.assign(lr, None)
    assert not any(s.rank is not None for s in t.all())  # what the old check read as "all finished"
    assert node_part(t.all(), {0: "n/w0-g1", 1: "n/w1-g1"}) == "running"


def test_a_failed_rank_the_leader_has_not_replanned_yet_is_running() -> None:
    t = _table(2)
    t.exited(0, ok=True)
    t.exited(1, ok=False)
    assert node_part(t.all(), MINE) == "running"


def test_ranks_moved_elsewhere_with_no_spare_left_is_moved() -> None:
    t = _table(2)
    for lr in (0, 1):
        t.assign(lr, None)  # killed by the follower; the membership runs ranks 0 and 1 on another node
    assert node_part(t.all(), {}) == "moved"


def test_ranks_moved_elsewhere_with_a_live_spare_serves_as_spares() -> None:
    t = _table(2, 1)
    for lr in (0, 1):
        t.assign(lr, None)
    assert node_part(t.all(), {}) == "spares"


def test_a_node_that_never_ran_a_rank_is_spare_only() -> None:
    assert node_part(_table(0, 2).all(), {}) == "spare_only"


def test_a_spare_that_took_a_rank_and_finished() -> None:
    t = _table(0, 2)
    t.assign(1, 3)  # the spare in slot 1 took rank 3
    t.exited(1, ok=True)
    assert node_part(t.all(), {3: "n/w1"}) == "finished"


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 4), spares=st.integers(0, 2), data=st.data())
def test_never_finished_while_a_rank_placed_here_has_not_ended_well(n: int, spares: int, data: st.DataObject) -> None:
    """Over any slot history and membership: ``finished`` only when every rank the membership places here
    ended well in the very worker it names, and ``moved`` only when it places none here and no live
    spare or ranked worker is left."""
    t = _table(n, spares)
    for lr in range(n + spares):
        if data.draw(st.booleans(), f"exited {lr}"):
            t.exited(lr, ok=data.draw(st.booleans(), f"ok {lr}"))
        if data.draw(st.booleans(), f"unassigned {lr}"):
            t.assign(lr, None)
        elif lr >= n and data.draw(st.booleans(), f"spare {lr} took a rank"):
            t.assign(lr, 10 + lr)
    slots = t.all()
    placed = data.draw(st.dictionaries(st.integers(0, 20), st.sampled_from(
        [s.worker_id for s in slots] + ["elsewhere/w0", "n/w0-g1"]), max_size=4), "mine")
    part = node_part(slots, placed)
    by_worker = {s.worker_id: s for s in slots}
    if part == "finished":
        assert placed
        for w in placed.values():
            s = by_worker.get(w)
            assert s is not None and s.succeeded and not s.alive
    if part in ("moved", "spares"):
        assert not placed
        assert not any(s.alive and s.rank is not None for s in slots)
    if part == "moved":
        assert not any(s.spare and s.alive for s in slots)
    if any(s.alive and s.rank is not None for s in slots):
        assert part in ("running", "spare_only")
