"""The compact roster of a membership and a plan (issue 20): exact round trips, size O(nodes + changes)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.errors import RecoveryError
from ckptless.recovery import roster
from ckptless.recovery.decision import Assignment, RecoveryPlan, Rollback
from ckptless.recovery.wire import Membership, decision_from_doc, decision_to_doc, membership_from_json, membership_to_json


def _job(world: int, per_node: int, replaced: dict[int, Assignment] | None = None) -> tuple[Assignment, ...]:
    out = []
    for r in range(world):
        node = f"host-{r // per_node:05d}.cluster.example"
        out.append(Assignment(r, f"{node}/w{r % per_node}", node, "survivor"))
    for r, a in (replaced or {}).items():
        out[r] = a
    return tuple(out)


names = st.text(st.sampled_from("ab/w01-"), min_size=1, max_size=6)


@st.composite
def rosters(draw: st.DrawFn) -> tuple[Assignment, ...]:
    world = draw(st.integers(1, 40))
    nodes = draw(st.lists(names, min_size=1, max_size=5, unique=True))
    out = []
    for r in range(world):
        node = draw(st.sampled_from(nodes))
        kind = draw(st.sampled_from(["member", "member", "other"]))
        worker = f"{node}/w{draw(st.integers(0, 9))}" if kind == "member" else draw(names)
        out.append(Assignment(r, worker, node, draw(st.sampled_from(["survivor", "spare", "respawn"]))))
    return tuple(out)


@settings(max_examples=150, deadline=None)
@given(rosters())
def test_roster_round_trips_exactly(ranks: tuple[Assignment, ...]) -> None:
    doc = json.loads(json.dumps(roster.encode(ranks)))
    assert roster.decode(doc, "test") == ranks


@settings(max_examples=200, deadline=None)
@given(rosters(), st.data())
def test_rollbacks_round_trip_exactly(ranks: tuple[Assignment, ...], data: st.DataObject) -> None:
    chosen = sorted(data.draw(st.sets(st.integers(0, len(ranks) - 1))))
    rollbacks = tuple(Rollback(r, ranks[r].worker_id if data.draw(st.booleans()) else "elsewhere/x",
                               data.draw(st.integers(5, 7)), 4) for r in chosen)
    doc = json.loads(json.dumps(roster.encode_rollbacks(rollbacks, ranks)))
    assert roster.decode_rollbacks(doc, ranks, "test") == rollbacks


def test_a_job_of_runs_costs_its_nodes_not_its_ranks() -> None:
    """W = 16,384 on 2,048 nodes, one respawn: the membership and its plan stay a few hundred KiB, not
    the ~100 bytes per rank (twice: ranks and the plan's assignments) of one entry per rank."""
    small, big = [len(membership_to_json(_membership(w, 8))) for w in (1024, 16384)]
    per_node = (big - small) / ((16384 - 1024) / 8)
    assert per_node < 200, per_node  # bytes per added node (8 ranks), ranks + plan + rollbacks together
    m = _membership(16384, 8)
    assert membership_from_json(membership_to_json(m)) == m


def _membership(world: int, per_node: int) -> Membership:
    respawn = Assignment(3, "host-00000.cluster.example/respawn-g1-r3", "host-00000.cluster.example", "respawn")
    ranks = _job(world, per_node, {3: respawn})
    plan = RecoveryPlan("job", 1, ranks, (3,), 40, tuple(Rollback(r, ranks[r].worker_id, 41, 40)
                                                          for r in range(world) if r != 3),
                        (), False, (), 1)
    return Membership(1, world, "host-00000", 29500, ranks, plan)


def test_plan_round_trips_through_the_wire() -> None:
    m = _membership(64, 8)
    assert isinstance(m.decision, RecoveryPlan)
    assert decision_from_doc(json.loads(json.dumps(decision_to_doc(m.decision)))) == m.decision


def test_older_one_entry_per_rank_records_still_read() -> None:
    raw = json.dumps({"generation": 0, "world_size": 2, "store": ["h", 1],
                      "ranks": [[0, "n/w0", "n", "survivor"], [1, "n/w1", "n", "survivor"]], "decision": None})
    assert membership_from_json(raw.encode()).ranks == (Assignment(0, "n/w0", "n", "survivor"),
                                                         Assignment(1, "n/w1", "n", "survivor"))


@pytest.mark.parametrize("doc", [
    {"nodes": ["n"], "runs": [[0, 2, 0, "survivor", 0], [1, 0, "survivor", "x"]]},  # rank 1 twice
    {"nodes": ["n"], "runs": [[1, 1, 0, "survivor", 0]]},  # rank 0 missing
    {"nodes": ["n"], "runs": [[0, 1, 3, "survivor", 0]]},  # node index out of range
    {"nodes": ["n"], "runs": [[0, 1, 0, "ghost", 0]]},  # unknown source
    {"runs": []},
])
def test_malformed_rosters_fail_clearly(doc: object) -> None:
    with pytest.raises(RecoveryError, match="roster|malformed"):
        roster.decode(doc, "membership")


def test_worker_of_and_rank_of_are_lookups() -> None:
    m = _membership(4096, 8)
    assert m.worker_of(4095).worker_id.endswith("/w7") and m.rank_of(m.worker_of(17).worker_id) == 17
    assert m.rank_of("nobody") is None
    with pytest.raises(RecoveryError):
        m.worker_of(4096)
