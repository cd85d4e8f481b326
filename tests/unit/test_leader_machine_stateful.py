"""Hypothesis drives the leader machine through random interleavings of faults, reports,
readiness, spares, node losses, lost etcd replies and time, checking invariants after each step:

* generations advance by exactly one per publish (the fake etcd asserts it);
* nothing is published after the job ended, and a user error always ends it;
* a leader whose lease lapsed (another agent leads) writes no incident, status or generation;
* the machine never raises, and once faults stop and every live rank reports
  and resumes, it settles (Watching, Ended or Deposed) in bounded time.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ckptless.recovery.facts import Worker
from ckptless.recovery.leader_machine import (
    AwaitingFormation,
    Collecting,
    Deposed,
    Ended,
    WaitingForReplacement,
    Watching,
    is_terminal,
)

from ..harness.leader_sim import Leader, World


class LeaderSim(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ld = Leader(World())
        self.ld.observe()
        self.spare_n = 0
        self.user_error_seen = False
        self.published_at_end: int | None = None
        self.writes_when_gone: tuple[object, ...] | None = None

    @property
    def w(self) -> World:
        return self.ld.world

    # --- faults -------------------------------------------------------------------------------
    @rule(rank=st.integers(0, 3))
    def kill(self, rank: int) -> None:
        if self.w.view().current_exit(rank) is None:
            self.w.kill(rank, t=self.ld.now)

    @rule(rank=st.integers(0, 3))
    def user_error(self, rank: int) -> None:
        if self.w.view().current_exit(rank) is None:
            self.w.user_error(rank, t=self.ld.now)
            self.user_error_seen = True

    @rule(node=st.sampled_from(["n0", "n1"]))
    def lose_node(self, node: str) -> None:
        self.w.lose_node(node)

    @rule(node=st.sampled_from(["n0", "n1"]))
    def node_back(self, node: str) -> None:
        self.w.nodes.add(node)

    @rule()
    def add_spare(self) -> None:
        self.spare_n += 1
        self.w.spares.append(Worker(f"s/{self.spare_n}", "s"))
        self.w.nodes.add("s")

    @rule()
    def lose_reply(self) -> None:
        self.w.lose_next_reply = True

    @rule(deposed=st.booleans())
    def fence(self, deposed: bool) -> None:
        self.w.fence_next = deposed

    @rule()
    def leader_paused_past_its_lease(self) -> None:
        """Another agent leads from now on (ours lapsed while paused): none of our writes may land."""
        if not self.w.leader_gone:
            self.w.leader_gone = True
            self.writes_when_gone = (len(self.w.incidents), self.w.status, len(self.w.published))

    # --- progress -------------------------------------------------------------------------------
    @rule()
    def everyone_reports(self) -> None:
        self.w.report_all_alive()

    @rule(rank=st.integers(0, 3))
    def one_reports(self, rank: int) -> None:
        if self.w.view().current_exit(rank) is None:
            a = self.w.membership.worker_of(rank)
            self.w.report(rank, fresh=a.source != "survivor" and rank not in self.w.ready)

    @rule()
    def everyone_ready(self) -> None:
        self.w.ready_all()

    @rule(dt=st.sampled_from([0.0, 0.05, 0.5, 1.5, 6.0, 25.0, 70.0]))
    def observe(self, dt: float) -> None:
        self.ld.observe(dt)

    # --- settling ---------------------------------------------------------------------------------
    @precondition(lambda self: not is_terminal(self.ld.state))
    @rule()
    def faults_stop_and_job_settles(self) -> None:
        """No more faults: live ranks report and resume; within bounded time the machine settles."""
        self.w.lose_next_reply = False
        self.w.fence_next = None
        if self.w.leader_gone:  # its successor settles the job; this one writes nothing (the invariant)
            return
        for _ in range(60):
            if isinstance(self.ld.state, (Collecting, WaitingForReplacement)):
                self.w.report_all_alive()
            if isinstance(self.ld.state, AwaitingFormation):
                self.w.ready_all()
            self.ld.observe(20.0)
            if isinstance(self.ld.state, (Ended, Deposed)):
                return
            if isinstance(self.ld.state, Watching) and (not self.w.view().faulted or self.w.view().finished):
                return
        raise AssertionError(f"did not settle: {self.ld.state}")

    # --- invariants ---------------------------------------------------------------------------------
    @invariant()
    def nothing_published_after_the_end(self) -> None:
        if isinstance(self.ld.state, Ended):
            if self.published_at_end is None:
                self.published_at_end = len(self.w.published)
            assert len(self.w.published) == self.published_at_end

    @invariant()
    def user_error_always_ends_the_job(self) -> None:
        view = self.w.view()
        if view.user_errors and not is_terminal(self.ld.state):
            self.ld.observe(0.0)
            assert is_terminal(self.ld.state) or self.w.view().finished, self.ld.state
            if isinstance(self.ld.state, Ended):
                assert self.ld.state.state == "failed"

    @invariant()
    def a_leader_that_lost_its_lease_writes_nothing(self) -> None:
        if self.writes_when_gone is not None:
            assert (len(self.w.incidents), self.w.status, len(self.w.published)) == self.writes_when_gone

    @invariant()
    def generations_consecutive(self) -> None:
        gens = [d.generation for d in self.w.published]
        assert gens == list(range(1, len(gens) + 1))
        assert self.w.membership.generation == len(gens)


LeaderSim.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLeaderMachine = LeaderSim.TestCase
