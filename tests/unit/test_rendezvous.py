"""The rendezvous' pure decisions (``coordinator/rendezvous.py``): who joins a round, and what a late
agent is told.

Issue 22: an agent that arrives after the job formed (a scheduler's replacement for a lost node) or
beyond ``--nnodes``' maximum is told it is *late* (``RendezvousLate``), which the launcher turns into
spares for the running job instead of an exit; a round whose nodes are all gone still starts anew.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptless.coordinator.rendezvous import NodeInfo, RoundState, decide_join
from ckptless.errors import ConfigError, RendezvousClosed, RendezvousLate


def node(i: int) -> NodeInfo:
    return NodeInfo(f"n{i}", "127.0.0.1", 2)


def test_a_late_agent_of_a_live_job_is_late_not_an_error_of_its_own() -> None:
    closed = RoundState(0, "closed", (node(0), node(1)), 2, 2)
    with pytest.raises(RendezvousLate, match="closed with 2 node"):
        decide_join(closed, node(2), 2, 2, {"n0", "n2"})  # node 1 is gone: n2 comes to replace it
    assert issubclass(RendezvousLate, RendezvousClosed)  # callers that catch "closed" still do


def test_one_agent_beyond_the_maximum_is_late_too() -> None:
    full = RoundState(0, "joining", (node(0), node(1)), 1, 2)
    with pytest.raises(RendezvousLate, match="full"):
        decide_join(full, node(2), 1, 2, {"n0", "n1", "n2"})


def test_a_round_whose_nodes_are_all_gone_starts_anew() -> None:
    closed = RoundState(3, "closed", (node(0), node(1)), 2, 2)
    fresh = decide_join(closed, node(5), 2, 2, {"n5"})
    assert fresh is not None and fresh.round == 4 and fresh.ids() == ["n5"]


def test_other_nnodes_is_a_config_error_naming_the_field() -> None:
    open_round = RoundState(0, "joining", (node(0),), 2, 2)
    with pytest.raises(ConfigError, match="nnodes"):
        decide_join(open_round, node(1), 1, 4, {"n0", "n1"})


@given(st.integers(1, 6), st.integers(0, 6), st.booleans())
def test_a_closed_round_with_a_live_node_never_admits_another(n: int, live_extra: int, me_known: bool) -> None:
    parts = tuple(node(i) for i in range(n))
    closed = RoundState(0, "closed", parts, n, n)
    me = node(0) if me_known else node(100)
    live = {"n0"} | {f"x{i}" for i in range(live_extra)}
    if me_known:
        assert decide_join(closed, me, n, n, live) is None  # already in it: nothing to write
    else:
        with pytest.raises(RendezvousLate):
            decide_join(closed, me, n, n, live)
