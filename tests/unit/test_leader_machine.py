"""Every transition of the leader machine, with a fake clock and fake facts (no etcd, no processes).

The world is 4 ranks on nodes n0 (ranks 0, 1) and n1 (ranks 2, 3), K = 1 with the
real node-aware ring placement (holders: 0 <- 2, 1 <- 3, 2 <- 1, 3 <- 0), committed
version 4; see tests/harness/leader_sim.py. Independent pairs: (0, 1) and (2, 3).
"""

from __future__ import annotations

import pytest

from ckptless.recovery.decision import RecoveryPlan, Unrecoverable
from ckptless.recovery.facts import PlanPolicy, ReplicaFact, Worker, WorkerReport
from ckptless.recovery.leader_machine import (
    AskGrow,
    AwaitingFormation,
    Collecting,
    Deposed,
    EndJob,
    Ended,
    Fenced,
    Observed,
    OpenIncident,
    NoteWaiting,
    Planned,
    PlanFailed,
    Planning,
    Publish,
    Published,
    PublishRejected,
    Publishing,
    Resign,
    WaitingForReplacement,
    Watching,
    step,
)
from ckptless.recovery import give_up
from ckptless.recovery.view import ExitRecord, JobStatus, ReportRecord, report_record_from_json, report_record_to_json
from ckptless.recovery.wire import decision_from_doc, decision_to_doc

from ..harness.leader_sim import CFG, Leader, World, fresh_leader


def published_generations(ld: Leader) -> list[int]:
    return [d.generation for d in ld.world.published]


def recover_fully(ld: Leader, dt: float = 0.1) -> None:
    """Let every live rank report, then every rank resume: the incident ends."""
    ld.world.report_all_alive()
    ld.observe(dt)
    assert isinstance(ld.state, AwaitingFormation), ld.state
    ld.world.ready_all()
    ld.observe(dt)
    assert isinstance(ld.state, Watching), ld.state


# --- the normal incident --------------------------------------------------------------------------
def test_quiet_job_stays_watching() -> None:
    ld = fresh_leader()
    for _ in range(5):
        assert ld.observe(100.0) == Watching(0)
    assert not ld.log


def test_one_kill_walks_every_state_once() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    assert isinstance(ld.observe(0.1), Collecting)
    assert any(isinstance(a, OpenIncident) and a.lost == (1,) for a in ld.log)
    ld.world.report_all_alive()
    state = ld.observe(0.1)  # reports complete -> plan -> publish -> awaiting formation, in one pass
    assert isinstance(state, AwaitingFormation) and state.generation == 1
    plan = ld.world.published[0]
    assert isinstance(plan, RecoveryPlan) and plan.resume_version == 4
    assert {a.rank: a.source for a in plan.assignments}[1] == "respawn"
    ld.world.ready = {0, 2, 3}
    assert isinstance(ld.observe(1.0), AwaitingFormation)
    ld.world.ready_all()
    assert ld.observe(0.1) == Watching(1)


def test_fresh_replacement_need_not_report() -> None:
    """A replacement still booting holds nothing: the plan does not wait for it."""
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    recover_fully(ld)
    ld.world.kill(0)  # gen 1; rank 1 is a respawn that already resumed (ready) -> must report
    ld.observe(0.1)
    ld.world.report(2)
    ld.world.report(3)
    assert isinstance(ld.observe(0.1), Collecting), "rank 1 resumed in gen 1: its report is needed"
    ld.world.report(1)
    assert isinstance(ld.observe(0.1), AwaitingFormation)
    assert published_generations(ld) == [1, 2]


# --- user errors vs faults --------------------------------------------------------------------------
def test_user_error_ends_the_job_without_a_plan() -> None:
    ld = fresh_leader()
    ld.world.user_error(1)
    state = ld.observe(0.1)
    assert isinstance(state, Ended) and state.state == "failed"
    assert "rank 1" in state.reason and "ValueError: boom" in state.reason and "user error" in state.reason
    end = [a for a in ld.log if isinstance(a, EndJob)]
    assert end and end[0].status.root_cause is not None and end[0].status.root_cause.rank == 1
    assert not ld.world.published


def test_a_replica_mismatch_stop_ends_the_job_as_corruption_not_as_a_user_error() -> None:
    """Issue 35, finding 9: the replica check's stop (mirror/replica_check.py) leaves like a user error
    (never retried), but it is not the script's bug, and the job's end says so."""
    from dataclasses import replace as with_

    from ckptless.recovery.view import ErrorSummary

    ld = fresh_leader()
    ld.world.user_error(1)
    ld.world.exits[1] = with_(ld.world.exits[1], error=ErrorSummary(
        "SilentDataCorruption", "silent data corruption at step 5: no majority: ranks 0, 1 hold one copy, ..."))
    state = ld.observe(0.1)
    assert isinstance(state, Ended) and state.state == "failed"
    assert "user error" not in state.reason and "silent data corruption: replicas that must agree do not" in state.reason
    assert not ld.world.published


def test_user_error_in_every_waiting_state_ends_the_job() -> None:
    for setup in ("collecting", "waiting", "formation"):
        ld = fresh_leader()
        if setup == "collecting":
            ld.world.kill(1)
            ld.observe(0.1)
            assert isinstance(ld.state, Collecting)
            ld.world.user_error(3)
        elif setup == "waiting":
            ld.world.lose_node("n1")
            ld.world.report(0)
            ld.world.report(1)
            ld.observe(0.1)
            ld.observe(2.0)
            assert isinstance(ld.state, WaitingForReplacement), ld.state
            ld.world.user_error(0)
        else:
            ld.world.kill(1)
            ld.observe(0.1)
            ld.world.report_all_alive()
            ld.observe(0.1)
            assert isinstance(ld.state, AwaitingFormation)
            ld.world.user_error(2)
        state = ld.observe(0.1)
        assert isinstance(state, Ended) and state.state == "failed", (setup, state)


def test_earliest_user_error_is_the_root_cause() -> None:
    ld = fresh_leader()
    ld.world.user_error(3, t=5.0)
    ld.world.user_error(1, t=2.0)
    state = ld.observe()
    assert isinstance(state, Ended) and state.reason.startswith("rank 1")


# --- failures during recovery: second, third, fourth ------------------------------------------------
def test_second_failure_while_collecting_joins_the_same_plan() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe(0.1)
    ld.world.report(2)
    ld.world.kill(0)  # independent of 1 (1's holder is 3, 0's holder is 2)
    ld.observe(0.1)
    assert isinstance(ld.state, Collecting) and ld.state.lost == {0, 1}
    ld.world.report(3)
    assert isinstance(ld.observe(0.1), AwaitingFormation)
    (plan,) = ld.world.published
    assert isinstance(plan, RecoveryPlan) and set(plan.lost_ranks) == {0, 1}


def test_replacement_dies_while_joining() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    ld.world.report_all_alive()
    ld.observe(0.1)
    first = ld.world.worker(1)
    ld.world.kill(1)  # the respawn of gen 1 dies before it resumed
    state = ld.observe(0.1)
    assert isinstance(state, Collecting) and state.generation == 1 and 1 in state.lost
    ld.world.report(0)
    ld.world.report(2)
    ld.world.report(3)
    assert isinstance(ld.observe(0.1), AwaitingFormation)
    assert published_generations(ld) == [1, 2]
    assert ld.world.worker(1) != first and "respawn-g2" in ld.world.worker(1)


def test_survivor_dies_while_replacement_joins_replans_with_the_replacement_kept() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    ld.world.report_all_alive()
    ld.observe(0.1)
    replacement = ld.world.worker(1)
    ld.world.kill(0)  # a survivor of gen 1 dies before anyone resumed
    ld.observe(0.1)
    ld.world.report(2)
    ld.world.report(3)  # the replacement (fresh) need not report
    assert isinstance(ld.observe(0.1), AwaitingFormation)
    plan = ld.world.published[-1]
    assert isinstance(plan, RecoveryPlan) and plan.generation == 2
    srcs = {a.rank: (a.worker_id, a.source) for a in plan.assignments}
    assert srcs[1] == (replacement, "respawn"), "the joining replacement keeps its rank and stays 'fresh'"
    assert {t.owner for t in plan.transfers} == {0, 1}


def test_four_failures_in_a_row_in_different_states() -> None:
    ld = fresh_leader()
    ld.world.kill(1)  # 1st: while watching
    ld.observe(0.1)
    ld.world.report(2)
    ld.world.kill(0)  # 2nd: while collecting
    ld.observe(0.1)
    ld.world.report(3)
    ld.observe(0.1)
    assert isinstance(ld.state, AwaitingFormation) and ld.state.generation == 1
    ld.world.kill(3)  # 3rd: while awaiting formation
    # rank 1's only holder (3) is gone and the respawn of 1 holds nothing: memory cannot cover it.
    ld.world.snapshot_step = 2
    ld.observe(0.1)
    ld.world.report(2)
    ld.observe(0.1)
    assert isinstance(ld.state, AwaitingFormation) and ld.state.generation == 2
    d2 = ld.world.published[-1]
    assert type(d2).__name__ == "DiskFallback"
    ld.world.ready_all()
    ld.observe(0.1)
    assert ld.state == Watching(2)
    ld.world.committed = 6
    ld.world.kill(0)  # 4th: after the disk restore, back to normal
    ld.observe(0.1)
    ld.world.report_all_alive()
    ld.observe(0.1)
    assert published_generations(ld) == [1, 2, 3]


def _waiting_for_node_1(**world: object) -> Leader:
    """Node n1 (ranks 2, 3) lost, the others reported, the gone-node grace over: no spare, no node (with
    ``--lost-node shrink`` in ``world``, planned at once instead)."""
    ld = fresh_leader(**world)
    ld.world.lose_node("n1")
    ld.world.report(0)
    ld.world.report(1)
    ld.observe(0.1)
    ld.observe(1.5)
    return ld


def test_second_failure_while_waiting_for_a_replacement_replans() -> None:
    ld = fresh_leader()
    ld.world.lose_node("n1")
    ld.world.report(0)
    ld.world.report(1)
    ld.observe(0.1)
    ld.observe(1.5)  # gone-node grace: ranks 2, 3 lost; no spare, no live node for them
    assert isinstance(ld.state, WaitingForReplacement)
    ld.observe(1.0)
    assert isinstance(ld.state, WaitingForReplacement), "no change: no re-plan"
    ld.world.spares = [Worker("s/a", "s"), Worker("s/b", "s")]
    ld.world.nodes.add("s")
    ld.observe(0.1)
    assert isinstance(ld.state, AwaitingFormation)
    plan = ld.world.published[0]
    assert {a.rank: a.source for a in plan.assignments}[2] == "spare"


def test_spare_dead_as_it_was_assigned_is_replanned_at_once() -> None:
    """The spare dies just before the plan that names it lands: its agent had no rank for it and wrote
    a spare exit (rank -1). The leader must see the assigned rank's worker dead at once and plan again.
    Was: believed alive, 'still joining ... waiting 60s more' four times (301.9 s)."""
    ld = fresh_leader()
    ld.world.spares = [Worker("s/a", "s"), Worker("s/b", "s")]
    ld.world.nodes.add("s")
    ld.world.kill(1)
    ld.observe()
    ld.world.report_all_alive()
    assert isinstance(ld.observe(0.1), AwaitingFormation)
    assigned = ld.world.worker(1)
    assert assigned in ("s/a", "s/b")
    ld.world.spare_exits[assigned] = ExitRecord(-1, assigned, "s", 999, None, 9, 0.05)
    state = ld.observe(0.1)
    assert isinstance(state, Collecting) and 1 in state.lost, state
    assert f"rank 1 ({assigned}, pid 999) ended by signal 9" in ld.messages()
    ld.world.report(0)
    ld.world.report(2)
    ld.world.report(3)
    assert isinstance(ld.observe(0.1), AwaitingFormation)
    again = ld.world.worker(1)
    assert again != assigned and again in ("s/a", "s/b"), "the dead spare was named again"


# --- deadlines ---------------------------------------------------------------------------------------
def test_silent_rank_is_lost_at_the_report_deadline() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    ld.world.report(2)
    ld.world.report(3)  # rank 0 never reports (its node is alive)
    ld.observe(CFG.report_timeout_s - 1)
    assert isinstance(ld.state, Collecting)
    ld.observe(2)
    assert isinstance(ld.state, Collecting), "a live process may be inside a collective: it gets longer"
    ld.observe(CFG.alive_report_timeout_s - CFG.report_timeout_s)
    assert "did not report within" in ld.messages()
    # 0 and 1 lost: 0's holder (2) and 1's holder (3) are alive -> a memory plan
    assert isinstance(ld.state, AwaitingFormation)


def test_no_replacement_before_the_deadline_ends_the_job_naming_the_ranks() -> None:
    ld = _waiting_for_node_1()
    ld.observe(CFG.replacement_timeout_s + 1)
    assert isinstance(ld.state, Ended) and ld.state.state == "failed"
    assert "[2, 3]" in ld.state.reason and "no replacement" in ld.state.reason


def test_a_spare_that_appears_while_the_plan_is_made_is_not_missed() -> None:
    """A new node offers its two spares one after the other: the plan sees one (still waiting for the
    other rank), the second appears before the leader's next look. The wait compares with what the plan
    saw, so it re-plans at once (was: the first look's key was taken as the reference, the second
    spare was never a change, and the job waited out --replacement-timeout with a spare at hand)."""
    ld = _waiting_for_node_1()
    assert isinstance(ld.state, WaitingForReplacement)
    ld.world.nodes.add("s")
    ld.world.spares = [Worker("s/a", "s")]
    ld.observe(0.1)  # one spare: rank 2 could be served, rank 3 not: still waiting
    assert isinstance(ld.state, WaitingForReplacement) and "[3]" in ld.state.reason
    ld.world.spares = [Worker("s/a", "s"), Worker("s/b", "s")]  # the second spare, before the next look
    ld.observe(0.1)
    assert isinstance(ld.state, AwaitingFormation), ld.state
    assert {a.rank: a.source for a in ld.world.published[0].assignments}[3] == "spare"


def test_a_wait_for_a_replacement_has_one_deadline_whatever_comes_and_goes() -> None:
    """Issue 22: a node that joins and leaves (or a spare that flaps) re-plans, but never extends the
    wait: nothing waits longer than --replacement-timeout; the wait is noted on the incident once."""
    ld = _waiting_for_node_1()
    assert isinstance(ld.state, WaitingForReplacement)
    deadline = ld.state.deadline
    notes = [a for a in ld.log if isinstance(a, NoteWaiting)]
    assert [(n.lost, n.deadline_in_s) for n in notes] == [((2, 3), CFG.replacement_timeout_s)]
    for k in range(3):  # a node appears (no spares, not the ranks' node) and vanishes: re-plans, same deadline
        ld.world.nodes.add(f"late{k}")
        ld.observe(CFG.replacement_timeout_s / 8)
        assert isinstance(ld.state, WaitingForReplacement) and ld.state.deadline == deadline
        ld.world.nodes.discard(f"late{k}")
        ld.observe(0.1)
    assert len([a for a in ld.log if isinstance(a, NoteWaiting)]) == 1
    ld.observe(deadline - ld.now + 0.1)
    assert isinstance(ld.state, Ended) and ld.state.state == "failed"
    assert "[2, 3]" in ld.state.reason and "--replacement-timeout" in ld.state.reason
    assert f"--rdzv-id {CFG.job_id}" in ld.state.reason  # what it waited for, and how to give it


def test_slow_but_alive_replacement_gets_extensions_then_a_replan() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    ld.world.report_all_alive()
    ld.observe(0.1)
    slow = ld.world.worker(1)
    ld.world.ready = {0, 2, 3}
    for i in range(CFG.formation_extensions):
        ld.observe(CFG.formation_timeout_s + 0.1)
        assert isinstance(ld.state, AwaitingFormation) and ld.state.extensions == i + 1
    assert "ranks [1] are still joining" in ld.messages()
    ld.world.ready = set()  # the survivors are waiting for rank 1 at the group barrier: not ready either
    ld.observe(CFG.formation_timeout_s + 0.1)
    assert isinstance(ld.state, Collecting) and ld.state.lost == {1}
    ld.world.report(0)
    ld.world.report(2)
    ld.world.report(3)
    ld.observe(0.1)
    assert published_generations(ld) == [1, 2] and ld.world.worker(1) != slow


def test_slow_replacement_that_arrives_within_an_extension_costs_nothing_more() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    ld.world.report_all_alive()
    ld.observe(0.1)
    ld.observe(CFG.formation_timeout_s + 0.1)
    ld.world.ready_all()
    assert ld.observe(0.1) == Watching(1)
    assert published_generations(ld) == [1]


# --- the coordinator's own failures -------------------------------------------------------------------
def test_lost_publish_reply_is_not_published_twice() -> None:
    ld = fresh_leader()
    ld.world.lose_next_reply = True
    ld.world.kill(1)
    ld.observe()
    ld.world.report_all_alive()
    ld.observe(0.1)
    assert isinstance(ld.state, Watching), "rejected reply: re-read"
    ld.observe(0.1)
    assert isinstance(ld.state, AwaitingFormation) and ld.state.generation == 1
    assert published_generations(ld) == [1]


def test_fenced_out_leader_resigns() -> None:
    ld = fresh_leader()
    ld.world.fence_next = True
    ld.world.kill(1)
    ld.observe()
    ld.world.report_all_alive()
    ld.observe(0.1)
    assert isinstance(ld.state, Deposed)
    assert any(isinstance(a, Resign) for a in ld.log)
    assert ld.observe(1) == ld.state, "a deposed machine does nothing more"


def test_a_leader_paused_past_its_lease_ends_nothing_when_it_resumes() -> None:
    """Issue 35: the leader was paused while it waited for a replacement; its lease lapsed and another
    agent leads. It resumes with its old state and a clock past the wait's deadline: the job's end it
    would write is fenced out, so it is deposed and the job goes on (its successor decides)."""
    ld = _waiting_for_node_1()
    ld.world.leader_gone = True
    ld.observe(CFG.replacement_timeout_s + 1)
    assert isinstance(ld.state, Deposed) and ld.world.status is None
    assert any(isinstance(a, Resign) for a in ld.log)
    assert ld.observe(1) == ld.state, "a deposed machine does nothing more"


def test_a_leader_paused_past_its_lease_opens_no_incident() -> None:
    """Resumed, the old leader reads reports its successor's incident caused: its own incident (an
    unfenced put before) is refused, and it says so instead of 'incident ... collecting reports'."""
    ld = fresh_leader()
    ld.world.leader_gone = True
    ld.world.kill(1)
    ld.observe(0.1)
    assert isinstance(ld.state, Deposed) and not ld.world.incidents
    assert "no longer the leader" in ld.messages()


def test_fenced_moves_every_live_state_to_deposed() -> None:
    """Ended too: the end it decided was refused by the fence, so it did not end the job; Deposed stays."""
    assert step(Deposed("y"), Fenced("x", 0.0), CFG) == (Deposed("y"), ())
    d = RecoveryPlan("job", 1, (), (1,), 4, (), (), True, (), 0)
    for s in (Ended("failed", "not written"), Watching(0), Collecting(0, frozenset({1}), 0.0, 10.0), Planning(0, frozenset({1}), 0.0),
              WaitingForReplacement(0, frozenset({1}), 0.0, 30.0, "r"), Publishing(0, d, 0.0),
              AwaitingFormation(1, 20.0)):
        nxt, actions = step(s, Fenced("gone", 1.0), CFG)
        assert isinstance(nxt, Deposed) and any(isinstance(a, Resign) for a in actions)
        assert not any(isinstance(a, (OpenIncident, EndJob, Publish)) for a in actions)


def test_new_leader_takes_over_an_open_incident() -> None:
    w = World()
    w.kill(1)
    w.incidents.add(0)
    w.report_all_alive()
    ld = Leader(w)
    ld.observe()
    assert isinstance(ld.state, AwaitingFormation) and published_generations(ld) == [1]


def test_new_leader_follows_a_generation_it_did_not_publish() -> None:
    w = World()
    ld = Leader(w)
    ld.observe()
    w.kill(1)
    w.report_all_alive()
    ld.state = Planning(0, frozenset({1}), 0.0)  # as if our reply were lost mid-plan
    ld.feed(PlanFailed("x", 0.0))
    assert isinstance(ld.state, Ended) and "internal error" in ld.state.reason


def test_status_written_elsewhere_ends_the_machine() -> None:
    ld = fresh_leader()
    ld.world.status = JobStatus("failed", "someone else decided")
    assert ld.observe() == Ended("failed", "someone else decided")


def test_stale_view_is_ignored() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    recover_fully(ld)
    old = World()
    old.kill(3)
    assert ld.observe() == Watching(1)
    ld.feed(Observed(old.view(), ld.now))
    assert ld.state == Watching(1)


# --- nodes -----------------------------------------------------------------------------------------------
def test_paused_agent_back_within_grace_costs_nothing() -> None:
    ld = fresh_leader()
    ld.world.lose_node("n1")
    ld.observe(0.1)
    ld.observe(CFG.node_grace_s - 1)
    assert isinstance(ld.state, Watching)
    ld.world.nodes.add("n1")
    ld.observe(0.1)
    ld.observe(CFG.node_grace_s + 1)
    assert isinstance(ld.state, Watching) and not ld.world.published


def test_paused_agent_beyond_grace_keeps_its_live_workers() -> None:
    ld = fresh_leader()
    ld.world.lose_node("n1")
    ld.observe(0.1)
    ld.observe(CFG.node_grace_s + 0.1)
    assert isinstance(ld.state, Collecting) and not ld.state.lost
    for r in range(4):  # its workers are alive: they report like everyone
        ld.world.report(r)
    ld.observe(0.1)
    (plan,) = ld.world.published
    assert isinstance(plan, RecoveryPlan) and not plan.lost_ranks and plan.resume_version == 4


def test_node_loss_waits_a_short_grace_for_reports_then_loses_its_ranks() -> None:
    ld = fresh_leader()
    ld.world.lose_node("n1")
    ld.world.report(0)
    ld.world.report(1)
    ld.world.spares = [Worker("s/a", "s"), Worker("s/b", "s")]
    ld.world.nodes.add("s")
    ld.observe(0.1)
    assert isinstance(ld.state, Collecting) and not ld.state.lost
    ld.observe(CFG.gone_node_report_grace_s + 0.1)
    assert isinstance(ld.state, AwaitingFormation)
    plan = ld.world.published[0]
    assert set(plan.lost_ranks) == {2, 3}


def test_node_lost_while_its_replacement_joins() -> None:
    ld = fresh_leader()
    ld.world.spares = [Worker("s/a", "s")]
    ld.world.nodes.add("s")
    ld.world.kill(1)
    ld.observe()
    ld.world.report_all_alive()
    ld.observe(0.1)
    assert ld.world.worker(1) == "s/a"
    ld.world.lose_node("s")
    ld.observe(0.1)
    ld.observe(CFG.gone_node_report_grace_s + 0.1)
    assert isinstance(ld.state, Collecting) and 1 in ld.state.lost


# --- endings ------------------------------------------------------------------------------------------------
def test_all_finished_is_success() -> None:
    ld = fresh_leader()
    for r in range(4):
        ld.world.finish(r)
    state = ld.observe()
    assert state == Ended("succeeded", "all 4 ranks finished")


def test_death_after_the_final_commit_is_not_recovered() -> None:
    ld = fresh_leader()
    ld.world.finish(0)
    ld.world.finish(1)
    ld.world.kill(2)
    assert isinstance(ld.observe(), Watching), "rank 3 is still finishing: hold, no incident"
    ld.world.finish(3)
    state = ld.observe()
    assert isinstance(state, Ended) and state.state == "succeeded"
    assert "died after the job's final version" in ld.messages()
    assert not ld.world.published


def test_unrecoverable_loss_names_the_ranks() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    ld.world.kill(3)  # 3 is 1's only holder; no snapshot
    ld.observe()
    ld.world.report_all_alive()
    state = ld.observe(0.1)
    assert isinstance(state, Ended) and state.state == "failed" and "unrecoverable" in state.reason
    assert "[1]" in state.reason


def test_recovery_limit_counts_recoveries_in_a_row_without_progress() -> None:
    """The recovery in force resumed at v4 and was the 49th in a row at v4 or earlier: a 50th at v4 ends the job."""
    ld = fresh_leader()
    ld.state = Planning(CFG.max_recoveries, frozenset({1}), 0.0, prior=(4, CFG.max_recoveries - 1, 0))
    d = RecoveryPlan("job", CFG.max_recoveries + 1, (), (1,), 4, (), (), True, (), 0)
    ld.feed(Planned(d, (), 0.0))
    assert isinstance(ld.state, Ended) and "gave up after 50 recoveries in a row without progress" in ld.state.reason


@pytest.mark.parametrize("prior, resume, stalled", [(None, 4, 0), ((3, 7, 0), 4, 0), ((4, 7, 0), 4, 8),
                                                    ((9, 0, 0), 4, 1)])
def test_a_long_job_recovers_past_any_lifetime_count(prior: tuple[int, int, int] | None, resume: int,
                                                     stalled: int) -> None:
    """Generation 5000, far past the limit: a job at scale that keeps making progress between failures is
    never given up; the published plan carries its count of recoveries in a row without progress."""
    state, actions = step(Planning(5000, frozenset({1}), 0.0, prior=prior),
                          Planned(RecoveryPlan("job", 5001, (), (1,), resume, (), (), True, (), 0), (), 0.0), CFG)
    assert isinstance(state, Publishing) and isinstance(state.decision, RecoveryPlan)
    assert state.decision.stalled == stalled and actions == (Publish(state.decision, 5000),)
    assert decision_from_doc(decision_to_doc(state.decision)) == state.decision


def test_malformed_replica_facts_are_excluded_not_fatal() -> None:
    """The PR-8 case: holders list the same replica twice after a rollback at the same version."""
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    ld.world.report_all_alive()
    rep = ld.world.reports[2].report
    dup = WorkerReport(rep.worker_id, rep.newest_captured, rep.committed, rep.local_versions,
                       rep.replicas)
    object.__setattr__(dup, "replicas", rep.replicas + (ReplicaFact(1, 4, 3), ReplicaFact(0, 4, 9)))
    ld.world.reports[2] = ReportRecord(dup, "x")
    ld.observe(0.1)
    assert isinstance(ld.state, AwaitingFormation)
    assert "ignoring replica of owner 0" not in ld.messages() or True
    assert isinstance(ld.world.published[0], RecoveryPlan)


def test_terminal_states_absorb_every_event() -> None:
    for st in (Ended("failed", "x"), Deposed("y")):
        for ev in (Observed(World().view(), 0.0), Published(1, 0.0), PublishRejected(True, "", 0.0),
                   PlanFailed("e", 0.0), Planned(Unrecoverable("job", 0, "r", ()), (), 0.0)):
            assert step(st, ev, CFG) == (st, ())


def test_results_of_actions_in_the_wrong_state_are_ignored() -> None:
    d = RecoveryPlan("job", 1, (), (1,), 4, (), (), True, (), 0)
    for ev in (Published(1, 0.0), PublishRejected(False, "", 0.0), PlanFailed("e", 0.0), Planned(d, (), 0.0)):
        assert step(Watching(0), ev, CFG) == (Watching(0), ())
    assert isinstance(step(Collecting(0, frozenset(), 0, 1), Published(1, 0.0), CFG)[0], Collecting)
    assert isinstance(step(Publishing(0, d, 0.0), Observed(World().view(), 0.0), CFG)[0], Publishing)
    assert any(isinstance(a, Publish) for a in step(Planning(0, frozenset({1}), 0.0), Planned(d, (), 0.0), CFG)[1])


def test_unported_script_ends_the_job_at_the_report_deadline() -> None:
    """A killed worker of a script that never called ckptless.init(): nothing can be recovered."""
    ld = fresh_leader(ported=False)
    ld.world.kill(1)
    ld.observe()
    ld.observe(CFG.report_timeout_s - 1)
    assert isinstance(ld.state, Collecting), "a slow boot still gets the whole report window"
    state = ld.observe(2)
    assert isinstance(state, Ended) and state.state == "failed"
    assert "ckptless.init()" in state.reason and "rank 1" in state.reason
    assert not ld.world.published


def test_early_kill_of_a_ported_job_restarts_from_the_initial_state() -> None:
    """R0: a kill before the first commit loses nothing a restart would not redo."""
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    for r in (0, 2, 3):  # the survivors captured v0 locally, nothing was committed or mirrored
        ld.world.reports[r] = ReportRecord(WorkerReport(ld.world.worker(r), 0, None, frozenset({0})), "x")
    ld.observe(0.1)
    assert isinstance(ld.state, AwaitingFormation)
    (plan,) = ld.world.published
    assert isinstance(plan, RecoveryPlan) and plan.resume_version == 0 and plan.initial_ranks == (1,)
    assert not plan.transfers


def test_silent_rank_whose_process_died_is_lost_at_the_report_deadline() -> None:
    ld = fresh_leader()
    ld.world.kill(1)
    ld.observe()
    ld.world.report(2)
    ld.world.report(3)
    ld.world.lose_node("n0")  # rank 0's node is gone too, and rank 0 never reports
    ld.observe(CFG.report_timeout_s + 1)
    assert isinstance(ld.state, AwaitingFormation) or isinstance(ld.state, WaitingForReplacement)


def test_give_up_names_the_last_cause() -> None:
    ld = fresh_leader()
    ld.state = Planning(CFG.max_recoveries, frozenset({1}), 0.0, "rank 1 ended by signal 9",
                        prior=(4, CFG.max_recoveries, 0))
    d = RecoveryPlan("job", CFG.max_recoveries + 1, (), (1,), 4, (), (), True, (), 0)
    ld.feed(Planned(d, (), 0.0))
    assert isinstance(ld.state, Ended) and "the last: rank 1 ended by signal 9" in ld.state.reason


# --- collectives that diverge after a resume (issue 38) ----------------------------------------------
@pytest.mark.parametrize("prior, resume, timed_out, count", [
    (None, 4, True, 1), ((4, 0, 0), 4, True, 1), ((4, 1, 1), 4, False, 0), ((3, 0, 1), 4, True, 1),
    ((4, 1, 1), 4, True, 2), ((5, 1, 1), 4, True, 2)])
def test_timed_out_incidents_are_counted_in_a_row_at_one_resume_version(
        prior: tuple[int, int, int] | None, resume: int, timed_out: bool, count: int) -> None:
    """Only incidents that are a collective timeout alone count, and only while no later version is resumed;
    the second in a row ends the job naming the fault, the first publishes a plan that carries the count."""
    state, actions = step(Planning(7, frozenset(), 0.0, "rank 2 (CollectiveTimeout: ...)", prior=prior,
                                   timed_out=timed_out),
                          Planned(RecoveryPlan("job", 8, (), (), resume, (), (), False, (), 0), (), 0.0), CFG)
    if count < 2:
        assert isinstance(state, Publishing) and isinstance(state.decision, RecoveryPlan)
        assert state.decision.timeouts == count
        assert decision_from_doc(decision_to_doc(state.decision)) == state.decision
    else:
        assert isinstance(state, Ended) and state.state == "failed"
        assert state.reason.startswith("CollectivesDiverged:") and "version 4" in state.reason
        assert "the last: rank 2 (CollectiveTimeout" in state.reason


def test_an_incident_is_a_collective_timeout_only_when_a_rank_reports_one_and_none_died() -> None:
    """Reported by the worker (its group measured a wait of the whole timeout), never read from a message."""
    ld = fresh_leader()
    ld.world.report_all_alive()
    assert not give_up.timed_out(ld.world.view())
    rec = ld.world.reports[2]
    ld.world.reports[2] = report_record_from_json(report_record_to_json(rec.report, "CollectiveTimeout: x",
                                                                        timed_out=True))
    assert ld.world.reports[2].timed_out and give_up.timed_out(ld.world.view())
    ld.world.kill(1)  # a rank died too: a timeout may follow from it, this is an ordinary incident
    assert not give_up.timed_out(ld.world.view())


# --- fewer ranks (--lost-node shrink) ------------------------------------------------------------------
def test_node_lost_with_shrink_goes_on_with_fewer_ranks_then_grows_back_when_spares_come() -> None:
    """Node n1 lost, no spare: the survivors host ranks 2 and 3 (each the rank whose image it holds) at
    once, nobody waits. Spares for both arrive: the leader asks that generation, once, to grow back; its
    processes leave together and the next plan gives ranks 2 and 3 to the spares."""
    ld = _waiting_for_node_1(policy=PlanPolicy(lost_node="shrink"), can_host=True)
    assert isinstance(ld.state, AwaitingFormation) and ld.state.generation == 1
    shrunk = ld.world.published[0]
    assert isinstance(shrunk, RecoveryPlan) and shrunk.hosted == {2: "n0/w1", 3: "n0/w0"}
    assert not any(isinstance(a, NoteWaiting) for a in ld.log), "nobody waited"
    ld.world.ready = {0, 1}  # the hosts resumed: their hosted ranks with them
    assert ld.observe(0.1) == Watching(1)
    assert ld.observe(5.0) == Watching(1), "no spare yet: stays shrunk"
    ld.world.spares = [Worker("s/a", "s"), Worker("s/b", "s")]
    ld.world.nodes.add("s")
    state = ld.observe(0.1)
    asks = [a for a in ld.log if isinstance(a, AskGrow)]
    assert isinstance(state, Watching) and state.grow_asked and asks == [AskGrow(1, (2, 3))]
    ld.observe(0.1)
    assert len([a for a in ld.log if isinstance(a, AskGrow)]) == 1, "asked once per generation"
    ld.world.report(0, reason="growing back to full width at step 9")  # they leave together
    ld.world.report(1, reason="growing back to full width at step 9")
    state = ld.observe(0.1)
    assert isinstance(state, AwaitingFormation) and state.generation == 2, state
    grown = ld.world.published[1]
    assert isinstance(grown, RecoveryPlan) and not grown.hosted
    assert {a.rank: a.source for a in grown.assignments} == {0: "survivor", 1: "survivor", 2: "spare", 3: "spare"}


def test_one_spare_for_two_hosted_ranks_is_not_a_reason_to_grow() -> None:
    """Growing back needs a spare per hosted rank: the next plan hosts every lost rank again otherwise."""
    ld = _waiting_for_node_1(policy=PlanPolicy(lost_node="shrink"), can_host=True)
    ld.world.ready = {0, 1}
    ld.observe(0.1)
    ld.world.spares = [Worker("s/a", "s")]
    ld.world.nodes.add("s")
    assert ld.observe(0.1) == Watching(1)
    assert not any(isinstance(a, AskGrow) for a in ld.log)
