"""Hypothesis drives the node agent's machine through random interleavings of memberships, worker exits,
re-execs, status records, incidents, stop signals, lease losses and time, with a slot table the actions
write as the driver would, checking after each step:

* the machine never raises, and a node that left never changes its exit code or asks for anything more;
* a kill only ever targets a live worker that the membership it follows does not name;
* every wait has a way out: a stop signal leaves with 128 + N at the next tick, the job's end (its status)
  leaves at the next tick, and a node cut off from etcd past the grace whose workers all ended leaves.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ckptless.launcher.node_machine import (
    Action, Assign, Event, Exit, ExitRecorded, Heartbeat, HeartbeatsRead, IncidentSeen, Kill, LeaseLost, LeaseRenewed, MembershipSeen, Node,
    NodeConfig, REAP_WAIT_S, Reexec, ReexecAsked, SpareDeferred, Spawned, StartRespawn, StartSpare, StatusSeen, StopRequested, Tick, step)
from ckptless.launcher.slots import Slot, SlotTable
from ckptless.recovery.decision import Assignment
from ckptless.recovery.view import ExitRecord, JobStatus
from ckptless.recovery.wire import Membership

CFG = NodeConfig("n", "h", 7, node_grace_s=10.0, lease_ttl_s=5.0, hang_timeout_s=5.0, spares=1, spare_refill=True)
WORLD = 3  # ranks 0 and 1 start here, rank 2 on node o


class NodeSim(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = SlotTable()
        for lr in range(2):
            self.t.add(Slot(lr, f"n/w{lr}", lr, f"hb{lr}"))
        self.t.add(Slot(2, "n/spare0", None, "hb2"))
        self.m = Membership(0, WORLD, "h", 7, (Assignment(0, "n/w0", "n", "survivor"),
                                               Assignment(1, "n/w1", "n", "survivor"),
                                               Assignment(2, "o/w0", "o", "survivor")))
        self.now = 0.0
        self.node = Node(CFG)
        self.exits = 0
        self.code: int | None = None
        self.spares_started: list[str] = []
        self.feed(MembershipSeen(self.m, ()))
        self.feed(Spawned())

    def feed(self, ev: Event) -> tuple[Action, ...]:
        before = self.node
        self.node, acts = step(self.node, ev, self.now)
        if before.exit_code is not None:
            assert self.node.exit_code == before.exit_code and acts == ()
        for a in acts:
            if isinstance(a, Exit):
                self.exits += 1
                self.code = a.code
            elif isinstance(a, Assign):
                self.t.assign(a.local_rank, a.rank)
            elif isinstance(a, Kill) and not isinstance(ev, HeartbeatsRead):
                assert isinstance(ev, MembershipSeen)
                slot = next(s for s in ev.slots if s.local_rank == a.local_rank)
                assert slot.alive and slot.worker_id not in {x.worker_id for x in ev.membership.ranks}
            elif isinstance(a, StartRespawn):  # what launcher/respawn.py does: its worker has exited
                assert not self.t.get(a.local_rank).alive, (a, self.t.all())
                self.t.reset(a.local_rank, a.assignment.worker_id, a.assignment.rank)
            elif isinstance(a, Reexec):
                self.t.reset(a.local_rank, a.worker_id, a.rank)
            elif isinstance(a, StartSpare):  # what launcher/refill.py does (etcd answered)
                assert a.worker_id not in self.spares_started, a
                self.spares_started.append(a.worker_id)
                self.t.add(Slot(len(self.t.all()), a.worker_id, None, f"hb{len(self.t.all())}"))
        return acts

    def slots(self) -> tuple[Slot, ...]:
        return tuple(self.t.all())

    # --- the coordinator -----------------------------------------------------------------------------------
    @rule(choices=st.lists(st.sampled_from(["keep", "respawn", "spare", "away"]), min_size=WORLD, max_size=WORLD))
    def new_membership(self, choices: list[str]) -> None:
        g = self.m.generation + 1
        ranks = []
        spares = [s for s in self.t.all() if s.spare and s.alive]
        for r, how in enumerate(choices):
            cur = self.m.worker_of(r)
            if how == "respawn":
                ranks.append(Assignment(r, f"n/r{g}-{r}", "n", "respawn"))
            elif how == "spare" and spares:
                ranks.append(Assignment(r, spares.pop().worker_id, "n", "spare"))
            elif how == "away":
                ranks.append(Assignment(r, f"o/r{g}-{r}", "o", "respawn"))
            else:
                ranks.append(Assignment(r, cur.worker_id, cur.node_id, "survivor"))
        self.m = Membership(g, WORLD, "h", 7, tuple(ranks))
        self.feed(MembershipSeen(self.m, self.slots()))

    @rule(ok=st.booleans())
    def job_status(self, ok: bool) -> None:
        self.feed(StatusSeen(JobStatus("succeeded" if ok else "failed", "x")))

    @rule(g=st.integers(0, 4), waiting=st.none() | st.just(3.0))
    def incident(self, g: int, waiting: float | None) -> None:
        self.feed(IncidentSeen(g, waiting))

    # --- the workers -----------------------------------------------------------------------------------------
    @rule(lr=st.integers(0, 2), ok=st.booleans())
    def worker_exits(self, lr: int, ok: bool) -> None:
        slot = self.t.get(lr)
        if not slot.alive:
            return
        self.t.exited(lr, ok)
        rec = ExitRecord(-1 if slot.rank is None else slot.rank, slot.worker_id, "n", 1, 0 if ok else None,
                         None if ok else 9, 0.0)
        self.feed(ExitRecorded(lr, rec, slot.rank is not None, ok, False))

    @rule()
    def spare_reexec(self) -> None:
        self.feed(ReexecAsked(2, self.slots()))

    @rule(lr=st.integers(0, 2), age=st.sampled_from([1.0, 6.0, 61.0]), starting=st.booleans())
    def heartbeat(self, lr: int, age: float, starting: bool) -> None:
        slot = self.t.get(lr)
        if slot.alive and slot.rank is not None:
            acts = self.feed(HeartbeatsRead((Heartbeat(lr, slot.rank, slot.worker_id, slot.heartbeat_file, age,
                                                       starting if age > 5.0 else None),)))
            killed = any(isinstance(a, Kill) for a in acts)
            assert killed == (self.node.exit_code is None and age > 5.0 and not (starting and age <= 60.0)), acts

    # --- the agent ----------------------------------------------------------------------------------------------
    @rule(sig=st.sampled_from([2, 15]))
    def stop(self, sig: int) -> None:
        self.feed(StopRequested(sig))
        self.tick(0.0, "none")
        assert self.node.exit_code is not None

    @rule()
    def lease_lost(self) -> None:
        self.feed(LeaseLost())

    @rule()
    def lease_renewed(self) -> None:
        self.feed(LeaseRenewed())

    @rule(deferred=st.booleans())
    def recovery_over_here(self, deferred: bool) -> None:
        """Every live rank trains in the current generation: an owed refill may start (etcd may be away)."""
        progress = {s.heartbeat_file: {"state": "training", "generation": self.m.generation}
                    for s in self.t.all() if s.alive and s.rank is not None}
        for a in self.feed(Tick(self.slots(), None, progress)):
            if isinstance(a, StartSpare) and deferred:
                self.spares_started.remove(a.worker_id)
                self.t.exited(len(self.t.all()) - 1, False)
                self.feed(SpareDeferred(a.worker_id))

    @invariant()
    def refills_never_go_negative(self) -> None:
        assert self.node.refills_owed >= 0 and self.node.refills_started >= 0

    @rule(dt=st.sampled_from([0.0, 0.5, 5.0, 20.0]), exits=st.sampled_from(["none", "some", "all"]))
    def tick(self, dt: float, exits: str) -> None:
        self.now += dt
        recs: tuple[ExitRecord, ...] | None = None
        if exits != "none":
            n = WORLD if exits == "all" else 1
            recs = tuple(ExitRecord(r, self.m.worker_of(r).worker_id, "n", 1, 0, None, 0.0) for r in range(n))
        self.feed(Tick(self.slots(), recs))

    # --- every wait has a way out ----------------------------------------------------------------------------
    @precondition(lambda self: self.node.exit_code is None)
    @rule()
    def the_job_ends(self) -> None:
        self.feed(StatusSeen(JobStatus("succeeded", "done")))
        self.tick(0.0, "none")
        assert self.node.exit_code in (0, 1) or (self.node.exit_code or 0) > 128, self.node

    @precondition(lambda self: self.node.exit_code is None and any(s.ever_ranked for s in self.t.all()))
    @rule()
    def cut_off_past_the_grace_with_every_worker_ended(self) -> None:
        self.feed(LeaseLost())
        for _ in range(3):  # a respawn that waited for one of them starts, and is cut off too
            for s in self.t.all():
                if s.alive:
                    self.worker_exits(s.local_rank, False)
        self.tick(CFG.node_grace_s + CFG.lease_ttl_s + 1.0, "none")
        assert self.node.exit_code is not None, (self.node, self.t.all())

    @invariant()
    def every_waiting_respawn_has_a_deadline_ahead(self) -> None:
        assert all(self.now < w.deadline <= self.now + REAP_WAIT_S for w in self.node.respawns)

    @invariant()
    def one_exit_at_most(self) -> None:
        assert self.exits <= 1
        assert self.code == self.node.exit_code


NodeSim.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestNodeMachine = NodeSim.TestCase
