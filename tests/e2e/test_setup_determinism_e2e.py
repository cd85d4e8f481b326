"""A replacement's setup builds what the original's built (issue 17: it could train silently on other data).

* An unseeded script that draws from the global torch RNG during its setup: a
  respawned replacement re-runs the setup; ``ckptless.init()`` seeded it the same
  way, so it draws the same numbers.
* A script whose setup reads its rank (``os.environ["RANK"]``) and keeps
  rank-specific, unprotected state: a pre-built spare built as another rank
  (``--spare-any-rank``) must not take the lost rank with its objects as built.
* The same when the rank is read before ``ckptless`` is even imported, by the
  spares of an agent that arrived after the job formed, pre-built or waiting for
  their rank (issue 35: they took the lost ranks with another rank's data and
  seeds, every rank's final state differed, every agent exited 0).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.report.status import read_status

from ..harness.cluster import (FaultFree, assert_bitwise_equal, assert_recovered, fault_free, kill_when_paused,
                               new_cluster, wait_membership)
from ..harness.waiting import wait_until

KNOBS = {"REF_UNSEEDED_DATA": "1", "REF_SETUP_READS_RANK": "1"}


@pytest.fixture(scope="module")
def baseline(module_etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> FaultFree:
    """The fault-free run of this module's job: the reference job with both setup knobs on."""
    return fault_free(module_etcd.endpoint, tmp_path_factory.mktemp("base"), **KNOBS)


def test_unseeded_setup_is_redrawn_the_same_by_a_replacement(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                             baseline: FaultFree) -> None:
    c = new_cluster(module_etcd.endpoint, tmp_path, "unseeded", **KNOBS, REF_PAUSE_RANK="1", REF_PAUSE_STEP="5")
    kill_when_paused(c, 1)
    assert_bitwise_equal(c.finals(), baseline.finals)
    assert c.pids(1)[-1]["role"] == "replacement"
    assert "does not seed torch before ckptless.init()" in c.log_text()  # the script is told, once


@pytest.mark.rotating(1)  # CI budget: tests/harness/rotation.py
def test_spare_whose_setup_read_its_rank_restarts_as_the_lost_rank(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                  baseline: FaultFree) -> None:
    c = new_cluster(module_etcd.endpoint, tmp_path, "readsrank", **KNOBS, REF_PAUSE_RANK="1", REF_PAUSE_STEP="5")
    try:
        c.start_agent()
        c.start_agent()
        c.start_agent("--spares", "1", "--spare-any-rank", nproc=0)
        pid = c.paused_pid(1)
        wait_until(lambda: any(c.out.glob("standby_*.json")), 120, "the spare built and standing by")
        standby = [json.loads(p.read_text())["rank"] for p in c.out.glob("standby_*.json")]
        assert standby == [0]
        os.kill(pid, signal.SIGKILL)
        c.wait()
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline.finals)
    text = c.log_text()
    assert "its setup read its rank (os.environ['RANK'] at" in text, c.tail()
    assert "train_ref.py" in text.split("its setup read its rank", 1)[1][:300]
    # Issue 38: the user was told at start, once for the job (by the spare pre-built as rank 0, before it
    # waited for a rank: its own line precedes the one it logs when assigned), where and what it costs.
    notice = "ckptless: this job's setup reads its rank (os.environ['RANK'] at "
    assert text.count(notice) == 1, c.tail()
    said = text.split(notice, 1)[1][:2000]
    assert "train_ref.py:" in said.split(")", 1)[0] and "Its setup took " in said and "s after it up to" in said
    assert text.index(notice) < text.index("cannot take rank 1 as built")


def test_late_nodes_spares_whose_setup_read_the_rank_at_import_restart_as_the_lost_ranks(
        module_etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    """An agent started after the job formed serves as two spares, pre-built as ranks 0 and 1 (no node
    was gone yet); the script reads RANK at import, before ckptless is imported, for its data and its
    per-rank seeds. Node 1 is lost: the spares are assigned ranks 2 and 3, see that read (they are
    watched from their first line) and restart as those ranks. Before issue 35's fix they took ranks
    2 and 3 with rank 0's and 1's data (the read was before any watch): all four final states differed
    from the fault-free run, and every agent exited 0."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "latereads", **{**KNOBS, "REF_SETUP_READS_RANK": "early"},
                    REF_PAUSE_RANK="2", REF_PAUSE_STEP="6")
    try:
        c.start_leader_then_others()
        wait_membership(c, 0)
        late = c.start_agent()  # the rendezvous is closed: it serves the job as 2 spares
        wait_until(lambda: len(list(c.out.glob("standby_*.json"))) == 2, 120, "the late node's spares built")
        standby = sorted(json.loads(p.read_text())["rank"] for p in c.out.glob("standby_*.json"))
        assert standby == [0, 1], standby  # built as ranks other than the ones they will take
        c.paused_pid(2)
        victim = c.agent_of_rank(2)
        os.kill(victim.pid, signal.SIGKILL)
        c.wait(expect_fail=[victim])
    finally:
        c.kill_all()
    assert_recovered(c, baseline, {2, 3})
    assert all(c.pids(r)[-1]["role"] == "spare" for r in (2, 3))
    log = c.logs[c.agents.index(late)].read_text()
    assert "arrived late" in log, log[-3000:]
    for r in (2, 3):
        assert f"cannot take rank {r} as built: its setup read its rank (os.environ['RANK'] at" in log, log[-3000:]
    assert "train_ref.py" in log.split("its setup read its rank", 1)[1][:300]


@pytest.mark.rotating(0)  # CI budget: tests/harness/rotation.py (the late node's read check: the test above)
def test_a_new_agent_without_prebuilt_spares_whose_script_read_the_rank_at_import_restarts_them(
        module_etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    """Issue 35's scenario: node 1 lost with no spare, the job waits, a new agent of the job arrives
    (--no-spare-prebuild: its spares wait in ckptless.init() with RANK=0 until assigned). The script read
    RANK=0 at import: each spare restarts as its rank. Before the fix both trained as rank 2 and 3 on rank
    0's data and seeds: all four final states differed, every agent exited 0, nothing was logged."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "latewait", **{**KNOBS, "REF_SETUP_READS_RANK": "early"},
                    REF_PAUSE_RANK="2", REF_PAUSE_STEP="6")
    try:
        c.start_leader_then_others()
        c.paused_pid(2)
        victim = c.agent_of_rank(2)
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: "ranks [2, 3]" in (read_status(c.endpoint, c.job_id).waiting or ""), 120,
                   "the leader noting that the job waits for a replacement")
        late = c.start_agent("--no-spare-prebuild")
        c.wait(expect_fail=[victim])
    finally:
        c.kill_all()
    assert_recovered(c, baseline, {2, 3})
    log = c.logs[c.agents.index(late)].read_text()
    assert "arrived late" in log, log[-3000:]
    for r in (2, 3):
        assert (f"cannot take rank {r} in this process: its script read its rank before ckptless.init() "
                "(os.environ['RANK'] at") in log, log[-3000:]
