"""Every transition of the worker machine, with a fake clock (no processes, no etcd).

Checked for every non-terminal state: a fault leads back to Leaving -> Reporting
-> Awaiting -> Forming of the next generation; a user error ends the worker at
once (never retried); the job ending ends it; each waiting state has a deadline
and a defined next state.
"""

from __future__ import annotations

import pytest

from ckptless.worker.machine import (
    Awaiting,
    AwaitMembership,
    Committed,
    CoordinatorLost,
    Exit,
    Failed,
    Fault,
    Finished,
    Finishing,
    FormFailed,
    Formed,
    FormGroups,
    Forming,
    Joining,
    JobEnded,
    LeaveGroups,
    Left,
    Leaving,
    MarkReady,
    MembershipSeen,
    Report,
    Reported,
    Reporting,
    Reprotected,
    RestoreFailed,
    RestoreState,
    Restored,
    Restoring,
    Started,
    State,
    Stepped,
    TimedOut,
    Train,
    Training,
    UserError,
    WaitFinalCommit,
    WorkerConfig,
    is_terminal,
    step,
)

CFG = WorkerConfig(join_timeout_s=100, form_timeout_s=50, await_timeout_s=70)

NON_TERMINAL: list[State] = [
    Joining(100.0), Forming(1, 50.0, True), Forming(0, 50.0, False), Restoring(1), Training(1, 5, True),
    Training(1, 5), Finishing(1), Leaving(1, "x"), Reporting(1, "x"), Awaiting(1, 70.0),
]


def run(state: State, *events: object) -> tuple[State, list[object]]:
    actions: list[object] = []
    for ev in events:
        state, acts = step(state, ev, CFG)  # type: ignore[arg-type]
        actions += acts
    return state, actions


def test_member_starts_forms_and_trains_without_restoring() -> None:
    s, acts = run(Joining(0.0), Started(0.0))
    assert s == Joining(100.0) and acts == [AwaitMembership(-1, 100.0)]
    s, acts = run(s, MembershipSeen(0, True, False, 1.0))
    assert s == Forming(0, 51.0, False) and acts == [FormGroups(0, 51.0)]
    s, acts = run(s, Formed(0, 0))
    assert s == Training(0, 0) and acts == [MarkReady(0), Train(0, 0, False)]
    s, acts = run(s, Stepped(10, done=True))
    assert s == Finishing(0) and acts == [WaitFinalCommit(0)]
    s, acts = run(s, Committed())
    assert isinstance(s, Finished) and isinstance(acts[0], Exit) and acts[0].kind == "finished"


def test_spare_waits_its_own_deadline_then_restores() -> None:
    s, acts = run(Joining(0.0), Started(0.0, deadline_s=1e6))
    assert acts == [AwaitMembership(-1, 1e6)]
    s, acts = run(s, MembershipSeen(3, False, True, 5.0))
    assert isinstance(s, Joining), "a membership without us: keep waiting"
    s, acts = run(s, MembershipSeen(3, True, True, 6.0), Formed(3, 0))
    assert s == Restoring(3) and acts[-1] == RestoreState(3)
    s, acts = run(s, Restored(8))
    assert s == Training(3, 8, reprotecting=True) and acts == [MarkReady(3), Train(3, 8, True)]
    s, acts = run(s, Reprotected(9))
    assert s == Training(3, 9) and acts == [Train(3, 9, False)]


def test_full_recovery_cycle_of_a_survivor() -> None:
    s: State = Training(0, 7)
    s, acts = run(s, Fault("peer died"))
    assert s == Leaving(0, "peer died") and acts == [LeaveGroups(0, "peer died")]
    s, acts = run(s, Left(10.0))
    assert s == Reporting(0, "peer died") and acts == [Report(0, "peer died")]
    s, acts = run(s, Reported(11.0))
    assert s == Awaiting(0, 81.0) and acts == [AwaitMembership(0, 81.0)]
    s, acts = run(s, MembershipSeen(0, True, True, 12.0))
    assert s == Awaiting(0, 81.0), "not newer: ignored"
    s, acts = run(s, MembershipSeen(1, True, True, 12.0))
    assert s == Forming(1, 62.0, True)
    s, acts = run(s, Formed(1, 0), Restored(5))
    assert s == Training(1, 5, reprotecting=True)


@pytest.mark.parametrize("state", [s for s in NON_TERMINAL if isinstance(s, (Forming, Restoring, Training, Finishing))])
def test_a_fault_in_every_active_state_leads_to_the_next_generation(state: State) -> None:
    g = getattr(state, "generation")
    s, acts = run(state, Fault("second failure"))
    assert s == Leaving(g, "second failure") and acts == [LeaveGroups(g, "second failure")]
    s, _ = run(s, Left(0.0), Reported(0.0), MembershipSeen(g + 1, True, True, 1.0))
    assert s == Forming(g + 1, 51.0, True)


def test_failures_while_forming_and_restoring() -> None:
    s, acts = run(Forming(2, 50.0, True), FormFailed("incident g2"))
    assert s == Leaving(2, "incident g2")
    s, acts = run(Restoring(2), RestoreFailed("holder died"))
    assert s == Leaving(2, "holder died")
    s, acts = run(Forming(2, 50.0, True), TimedOut(51.0))
    assert isinstance(s, Leaving) and "did not form" in s.reason


@pytest.mark.parametrize("state", NON_TERMINAL)
def test_user_error_fails_fast_from_every_state(state: State) -> None:
    s, acts = run(state, UserError("ValueError: boom"))
    assert s == Failed("user_error", "ValueError: boom") and acts == [Exit("user_error", "ValueError: boom")]


@pytest.mark.parametrize("state", NON_TERMINAL)
def test_job_ended_and_coordinator_lost_end_every_state(state: State) -> None:
    s, _ = run(state, JobEnded("unrecoverable"))
    assert s == Failed("job_ended", "unrecoverable")
    s, _ = run(state, CoordinatorLost("down 300s"))
    assert isinstance(s, Failed) and s.kind == "internal"


def test_excluded_from_the_next_generation_is_fenced() -> None:
    s, acts = run(Awaiting(3, 70.0), MembershipSeen(4, False, True, 1.0))
    assert isinstance(s, Failed) and s.kind == "fenced" and "generation 4" in s.message


def test_deadlines_have_defined_next_states() -> None:
    assert run(Joining(100.0), TimedOut(101.0))[0] == Failed("internal", "not admitted to the job before the deadline")
    s, _ = run(Awaiting(3, 70.0), TimedOut(71.0))
    assert isinstance(s, Failed) and s.kind == "internal"
    s, _ = run(Forming(3, 50.0, False), TimedOut(51.0))
    assert isinstance(s, Leaving)


@pytest.mark.parametrize("state", [Finished(1), Failed("fenced", "x")])
def test_terminal_states_absorb_everything(state: State) -> None:
    for ev in (Fault("x"), UserError("y"), JobEnded("z"), Committed(), TimedOut(0.0), Left(0.0)):
        assert step(state, ev, CFG) == (state, ())
    assert is_terminal(state)


def test_unexpected_events_keep_the_state() -> None:
    for st in NON_TERMINAL:
        for ev in (Committed(), Reported(0.0), Left(0.0), Restored(1), Reprotected(1)):
            nxt, acts = step(st, ev, CFG)
            expected_change = (
                (isinstance(st, Finishing) and isinstance(ev, Committed))
                or (isinstance(st, Reporting) and isinstance(ev, Reported))
                or (isinstance(st, Leaving) and isinstance(ev, Left))
                or (isinstance(st, Restoring) and isinstance(ev, Restored))
                or (isinstance(st, Training) and isinstance(ev, Reprotected))
            )
            assert (nxt != st) == expected_change, (st, ev, nxt)
