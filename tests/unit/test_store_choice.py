"""Which store a new generation uses (ckptless/recovery/store_choice.py): the workers' current one while its
agent runs ranks of the new generation, else the leader's own (issue 35)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ckptless.recovery.store_choice import store_for_generation

A, B = ("hostA", 4000), ("hostB", 5000)
NODES = [("nA", A), ("nB", B)]


def test_the_store_stays_while_its_agent_runs_ranks_of_the_new_generation() -> None:
    assert store_for_generation(A, B, NODES, ["nA/w0", "nB/w1", "nA/respawn-g1-r1"]) == A


def test_the_leaders_own_when_the_store_node_runs_none_of_them() -> None:
    # the store's node was lost: its ranks moved (a spare, fewer ranks); its lease may not have lapsed yet
    assert store_for_generation(A, B, NODES, ["nB/w0", "nB/w1", "nC/spare0"]) == B


def test_the_leaders_own_when_no_live_agent_advertises_the_store() -> None:
    assert store_for_generation(A, B, [("nB", B)], ["nA/w0", "nB/w1"]) == B


def test_unchanged_when_the_leader_hosts_it() -> None:
    assert store_for_generation(B, B, [], []) == B


@given(st.lists(st.tuples(st.sampled_from(["nA", "nB", "nC"]), st.sampled_from([A, B, ("hostC", 1)])), max_size=4),
       st.lists(st.sampled_from(["nA/w0", "nB/w0", "nC/w0", "nD/w3"]), max_size=6))
def test_always_one_of_the_two_and_the_previous_only_with_a_live_host_running_ranks(
        nodes: list[tuple[str, tuple[str, int]]], workers: list[str]) -> None:
    out = store_for_generation(A, B, nodes, workers)
    assert out in (A, B)
    if out == A:
        hosts = {n for n, addr in nodes if addr == A}
        assert any(w.split("/")[0] in hosts for w in workers)
