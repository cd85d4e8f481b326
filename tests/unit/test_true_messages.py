"""Lines that told a user something false (issue 35, finding 9), each checked against what happened.

* A fall-back to disk said "2 steps lost" when 9 were trained again: the plan counts from the newest
  version captured in memory, which stops moving while a job runs with fewer ranks (unmirrored) and
  moves every N steps with ``--mirror-every N``; a rank now counts the steps it trained itself.
* A job that went on with fewer ranks and never grew back ended "all 4 ranks finished" while no process
  of ranks 2-3 ran past the last step (none wrote its final state).
* A spare's exit was logged as "rank -1".
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ckptless.launcher.exit_records import record_exit
from ckptless.launcher.worker_process import WorkerExit
from ckptless.recovery.decision import Assignment, DiskFallback
from ckptless.recovery.executor import RestoreInputs, apply_decision, disk_restore_line
from ckptless.recovery.facts import PlanPolicy
from ckptless.recovery.leader_machine import Ended
from ckptless.recovery.view import ExitRecord, finished_line
from ckptless.recovery.wire import Membership

from ..harness.leader_sim import fresh_leader
from ..harness.snapshot_job import JOB, Job, run_and_snapshot
from .test_launcher_devices import _node


# --- a fall-back to disk --------------------------------------------------------------------------------
def test_a_fall_back_to_disk_counts_the_steps_the_rank_trained_past_the_snapshot() -> None:
    lost, line = disk_restore_line(1, 8, 17, 2, "no version of every rank survives in memory")
    assert lost == 9 and "9 steps lost" in line and "trained to step 17" in line and "2 steps" not in line
    assert disk_restore_line(1, 8, 8, 0, "r")[0] == 0
    lost, line = disk_restore_line(2, 8, None, 2, "r")  # a replacement trained nothing: the plan's floor
    assert lost == 2 and "at least 2 steps lost" in line and "captured in memory was 10" in line


def test_the_disk_restore_reports_the_ranks_own_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The restore itself (a real snapshot of step 4 loaded): the plan saw version 6 captured (2 steps),
    the rank had trained to step 13 (9 steps), as a job with fewer ranks trains unmirrored."""
    _, w = run_and_snapshot(tmp_path, 6, keep=3)
    w.close()
    m = Membership(1, 1, "h", 1, (Assignment(0, "n/w0", "n", "survivor"),))
    fresh = Job(seed=3)
    fallback = DiskFallback(JOB, 1, m.ranks, (), 4, "restoring snapshot step 4", (), 2)
    inputs = RestoreInputs(m, "n/w0", fresh.reg, [], None, 30.0, JOB, str(tmp_path / "snaps"), trained=13)
    with caplog.at_level(logging.WARNING):
        out = apply_decision(fallback, inputs)
    assert (out.resume_step, out.steps_lost) == (4, 9) and fresh.data.index == 4
    assert "9 steps lost" in caplog.text and "2 steps lost" not in caplog.text, caplog.text


# --- the end of a job that ran with fewer ranks ---------------------------------------------------------
def test_a_job_that_never_grew_back_does_not_say_every_rank_finished() -> None:
    """Node n1 (ranks 2, 3) lost, no spare, --lost-node shrink: ranks 0 and 1 host them and finish."""
    from .test_leader_machine import _waiting_for_node_1

    ld = _waiting_for_node_1(policy=PlanPolicy(lost_node="shrink"), can_host=True)
    ld.world.ready = {0, 1}
    ld.observe(0.1)
    ld.world.finish(0)
    ld.world.finish(1)
    state = ld.observe(0.1)
    assert isinstance(state, Ended) and state.state == "succeeded", state
    assert "all 4 ranks finished" not in state.reason, state.reason
    assert "ranks [2, 3] ran as micro-batches hosted by ranks [0, 1]" in state.reason
    assert "on 2 processes" in state.reason and "final state" in state.reason


def test_a_job_at_full_width_says_every_rank_finished() -> None:
    ld = fresh_leader()
    for r in range(4):
        ld.world.finish(r)
    assert ld.observe() == Ended("succeeded", "all 4 ranks finished")
    m = Membership(0, 2, "h", 1, (Assignment(0, "a", "n", "survivor"), Assignment(1, "b", "n", "survivor")))
    assert finished_line(m) == "all 2 ranks finished"


# --- a spare's exit -------------------------------------------------------------------------------------
def test_a_spares_exit_is_logged_by_its_worker_id_not_as_rank_minus_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    st, box = _node(tmp_path, 0, 2, 1)  # local rank 2 is a spare
    record_exit(st, WorkerExit(2, 42, 0, None, 9, 0.0, 1.0, False))
    assert "spare n/w2 (pid 42) ended by signal 9" in caplog.text, caplog.text
    assert "rank -1" not in caplog.text
    rec = ExitRecord.from_json(box.puts[st.keyspace.spare_exit("n/w2")])
    assert rec.rank == -1  # the record keeps its wire form: only what is said changed
    assert ExitRecord(-1, "n/w2", "n", -1, None, None, 0.0).describe() == "spare n/w2 was not started"
    assert ExitRecord(3, "n/w1", "n", 7, 1, None, 0.0).describe() == "rank 3 (n/w1, pid 7) ended by exit code 1"
