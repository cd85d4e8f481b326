"""A node lost with no spare anywhere (issue 22): the job holds for a replacement node, or ends clearly.

Real etcd, real agents and workers on localhost, real SIGKILL of a whole node (its agent, and its
workers by PDEATHSIG). No spares: before issue 22 the survivors' node ended the job after 60 s, and a
new agent started with the same ``--rdzv-id`` was refused as late. Now the leader notes on the
incident that the job waits (``ckptless status``), the survivors wait in memory with their state
and mirrors, and a new agent of the job serves as spares, pre-built as the lost ranks, and takes
them: the run ends bitwise equal to the fault-free one, survivors in their first processes. The
tests synchronise on the leader's note in etcd, never on a sleep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.report.status import read_status

from ..harness.cluster import Cluster, FaultFree, assert_recovered, new_cluster, wait_membership
from ..harness.waiting import wait_until


def _waiting(c: Cluster) -> dict[str, object] | None:
    """The leader's note that the job waits for a replacement (on the open incident), if any."""
    with c.client() as client:
        for kv in client.get_prefix(Keyspace(c.job_id).incident_prefix)[0]:
            doc = json.loads(kv.value)
            if isinstance(doc.get("waiting"), dict):
                return dict(doc["waiting"])
    return None


def _scrape(c: Cluster, agent: int) -> dict[str, float]:
    """Agent ``agent``'s Prometheus samples (it printed its URL: started with ``--metrics-port 0``)."""
    found = re.search(r"metrics at (http://\S+/metrics)", c.logs[agent].read_text())
    assert found is not None, c.logs[agent].read_text()[-2000:]
    with urllib.request.urlopen(found.group(1), timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def _lose_node_1(c: Cluster, *flags: str) -> tuple[object, set[int]]:
    """Agent 0 leads (ranks 0-1); the other node (ranks 2-3), paused at rank 2's pause point, is killed whole."""
    c.start_leader_then_others(*flags)
    c.paused_pid(2)
    victim = c.agent_of_rank(2)
    assert victim is not c.leader_agent()
    lost = {r for r in range(4) if c.agent_of_rank(r) is victim}
    os.kill(victim.pid, signal.SIGKILL)
    return victim, lost


def test_node_lost_without_spares_a_new_agent_takes_its_ranks(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                               baseline: FaultFree) -> None:
    c = new_cluster(module_etcd.endpoint, tmp_path, "newnode", REF_PAUSE_RANK="2", REF_PAUSE_STEP="6")
    try:
        victim, lost = _lose_node_1(c, "--metrics-port", "0")
        wait_until(lambda: _waiting(c) is not None, 120, "the leader noting that the job waits for a replacement")
        status = read_status(c.endpoint, c.job_id)
        assert "waiting for a replacement for ranks [2, 3]" in status.waiting, status
        since = float(_waiting(c)["since"])  # type: ignore[index, arg-type]
        wait_until(lambda: _scrape(c, 0).get("ckptless_replacement_waiting_since") == since, 30,
                   "the surviving node's metrics saying since when the job waits")
        # the link its mirrors use, measured once at start to the other node (launcher/mirror_link.py)
        assert _scrape(c, 0).get("ckptless_mirror_link_bits_per_second", 0.0) > 0
        mirrors = [str(n.get("mirrors")) for n in status.nodes]
        assert any("127.0.0.1" in m and "Gb/s to" in m for m in mirrors), mirrors
        newcomer = c.start_agent()  # the lost node's own command, as a scheduler would start it again
        c.wait(expect_fail=[victim])  # every other agent, the newcomer included, exits 0
    finally:
        c.kill_all()
    assert_recovered(c, baseline, lost)
    assert all(c.pids(r)[-1]["role"] == "spare" for r in lost)
    log = c.logs[c.agents.index(newcomer)].read_text()
    assert "arrived late: this node serves the job as 2 spare(s)" in log, log[-3000:]


@pytest.mark.rotating(1)  # CI budget: tests/harness/rotation.py
def test_no_replacement_within_the_timeout_ends_the_job_naming_the_ranks(module_etcd: EmbeddedEtcd,
                                                                         tmp_path: Path) -> None:
    c = new_cluster(module_etcd.endpoint, tmp_path, "nonode", REF_PAUSE_RANK="2", REF_PAUSE_STEP="4")
    try:
        c.start_agent("--replacement-timeout", "4")
        with c.client() as client:
            wait_until(lambda: bool(client.get_prefix(Keyspace(c.job_id).election_prefix)[0]), 120, "a leader")
        c.start_agent("--replacement-timeout", "4")
        c.paused_pid(2)
        victim = c.agent_of_rank(2)
        os.kill(victim.pid, signal.SIGKILL)
        survivor = next(a for a in c.agents if a is not victim)
        code = survivor.wait(timeout=120)
    finally:
        c.kill_all()
    assert code == 1
    text = c.tail(100000)
    assert "no replacement within 4s (--replacement-timeout)" in text, text[-3000:]
    assert "ranks [2, 3]" in text and f"--rdzv-id {c.job_id}" in text


@pytest.mark.rotating(2)  # CI budget: tests/harness/rotation.py
def test_an_agent_more_than_the_job_needs_serves_as_spares_and_takes_a_lost_node(module_etcd: EmbeddedEtcd,
                                                                                 tmp_path: Path,
                                                                                 baseline: FaultFree) -> None:
    """A third agent with --nnodes 2 (the job formed without it) neither ends nor re-forms the job: it
    serves as spares, and when node 1 is lost it takes ranks 2-3 at once (nobody waits)."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "extra", REF_PAUSE_RANK="2", REF_PAUSE_STEP="6")
    try:
        c.start_leader_then_others()
        wait_membership(c, 0)
        extra = c.start_agent()
        with c.client() as client:
            spares = Keyspace(c.job_id).spares_prefix
            wait_until(lambda: len(client.get_prefix(spares)[0]) == 2, 120, "the extra agent's two spares")
        c.paused_pid(2)
        victim = c.agent_of_rank(2)
        lost = {r for r in range(4) if c.agent_of_rank(r) is victim}
        os.kill(victim.pid, signal.SIGKILL)
        c.wait(expect_fail=[victim])
    finally:
        c.kill_all()
    assert_recovered(c, baseline, lost)
    assert all(c.pids(r)[-1]["role"] == "spare" for r in lost)
    assert "waiting for a replacement" not in c.tail(100000)
    assert "arrived late" in c.logs[c.agents.index(extra)].read_text()


@pytest.mark.slow  # the leader's own node lost with no spare; CI runs the other node's case above
def test_the_leaders_node_lost_without_spares_a_new_agent_takes_its_ranks(module_etcd: EmbeddedEtcd,
                                                                         tmp_path: Path,
                                                                         baseline: FaultFree) -> None:
    """Node 0 (the leader, ranks 0-1, generation 0's store) is lost with no spare: the other node's agent
    wins the election, waits for a replacement, and a new agent of the job takes ranks 0-1, bitwise."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "newleader", REF_PAUSE_RANK="0", REF_PAUSE_STEP="6")
    try:
        c.start_leader_then_others()
        c.paused_pid(0)
        victim = c.leader_agent()
        assert c.agent_of_rank(0) is victim
        lost = {r for r in range(4) if c.agent_of_rank(r) is victim}
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: _waiting(c) is not None, 120, "the new leader noting that the job waits")
        c.start_agent()
        c.wait(expect_fail=[victim])
    finally:
        c.kill_all()
    assert_recovered(c, baseline, lost)
    assert all(c.pids(r)[-1]["role"] == "spare" for r in lost)
