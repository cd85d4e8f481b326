"""The leader agent paused past the node grace (issue 35 finding 8): the job survives, the agent rejoins.

Real etcd, 2 agents x 2 workers of tests/harness/scripts/train_ref.py, K = 1, no spares, lease TTL
1 s, ``--node-grace 3``. Agent 0 leads, hosts generation 0's store and runs ranks 0-1. Rank 0 holds
at step 5 (its peers wait for it in a collective); the test SIGSTOPs agent 0 and keeps it stopped
until the other agent, now leading, has given node 0 up (its ranks lost with the node, the job
waiting for a replacement: the incident record says so), then SIGCONTs it. Agent 0 finds its lease
gone, registers again under a new one, and the leader plans ranks 0 and 1 again on node 0.

What must hold: every agent exits 0 and the job ends bitwise equal to the fault-free run; ranks 2 and
3 finish in their first processes (a healthy rank on the other node is never declared lost because
the leader was paused); the paused agent says its lease was renewed.

Was (issue 35): the follower unassigned agent 0's slots for the respawns of ranks 0 and 1, and its
main loop read "no slot holds a rank" as "all this node's ranks finished" before the respawn thread
had started them: agent 0 exited 0 without a word ("respawn of rank 0 failed ... group is stopping,
not respawning"), and the job failed "no replacement within 30s".
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.recovery.wire import Membership

from ..harness.cluster import FaultFree, assert_bitwise_equal, assert_recovered, new_cluster, wait_exit
from ..harness.waiting import wait_until

FLAGS = ("--node-grace", "3", "--replacement-timeout", "30")


def test_leader_agent_paused_past_node_grace_rejoins_and_the_job_survives(
        module_etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    c = new_cluster(module_etcd.endpoint, tmp_path, "leaderstop", REF_PAUSE_RANK="0", REF_PAUSE_STEP="5",
                    REF_PAUSE_RELEASE="release")
    ks = Keyspace(c.job_id)
    try:
        c.start_leader_then_others(*FLAGS)
        c.paused_pid(0)
        leader = c.leader_agent()
        assert leader is c.agent_of_rank(0), "agent 0 leads and runs ranks 0-1"
        os.kill(leader.pid, signal.SIGSTOP)
        try:
            with c.client() as cl:
                def waiting() -> bool:
                    kv = cl.get(ks.incident(0))
                    return kv is not None and isinstance(json.loads(kv.value).get("waiting"), dict)

                # The fault lasts until the new leader gave node 0 up: an etcd record, not a time.
                wait_until(waiting, 60, "the new leader waiting for a replacement of the paused node's ranks")
        finally:
            os.kill(leader.pid, signal.SIGCONT)
        c.release()
        c.wait(timeout=120)
    finally:
        c.kill_all()
    text = c.log_text()
    assert "lease renewed after it was lost" in text, c.tail()
    assert "did not report within" not in text, c.tail()
    assert_recovered(c, baseline, {0, 1})


@pytest.mark.rotating(0)  # CI budget: tests/harness/rotation.py (the paused leader's rejoin runs daily)
def test_leader_agent_paused_while_spares_took_its_ranks_says_so_and_exits_1(
        module_etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    """The same pause with a spare-only agent of two spares: the new leader gives ranks 0 and 1 to the
    spares and the job goes on without node 0. Resumed, agent 0 finds its ranks run elsewhere and keeps
    no spare: one line saying so, exit 1 (was: exit 0 without a word, as if its ranks had finished);
    the job ends bitwise, the other agents 0."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "leaderaway", REF_PAUSE_RANK="0", REF_PAUSE_STEP="5",
                    REF_PAUSE_RELEASE="release")
    try:
        c.start_leader_then_others(*FLAGS)
        c.start_agent(*FLAGS, "--spares", "2", nproc=0)
        c.paused_pid(0)
        leader = c.leader_agent()
        assert leader is c.agent_of_rank(0)
        os.kill(leader.pid, signal.SIGSTOP)
        try:
            def moved() -> bool:
                m = c.membership()
                return m is not None and m.generation >= 1 and _spares_run(m, (0, 1))

            wait_until(moved, 60, "ranks 0 and 1 given to the spares while agent 0 is paused")
        finally:
            os.kill(leader.pid, signal.SIGCONT)
        c.release()
        code = wait_exit(leader, 60, "the resumed agent 0")
        c.wait(timeout=120, expect_fail=[leader])
    finally:
        c.kill_all()
    log0 = c.logs[0].read_text(errors="replace")
    assert code == 1, log0[-3000:]
    assert "this node's ranks [0, 1] run on other nodes since generation" in log0, log0[-3000:]
    assert_bitwise_equal(c.finals(), baseline.finals)


def _spares_run(m: Membership, ranks: tuple[int, ...]) -> bool:
    return all(m.worker_of(r).source == "spare" for r in ranks)
