"""A fake world for the leader machine: views built from a few facts, a fake clock, a fake etcd.

Used by tests/unit/test_leader_machine.py (table-driven transitions) and
tests/unit/test_leader_machine_stateful.py (hypothesis). The planner is the real,
pure one (``gather.build_facts`` + ``plan_recovery``); only etcd is faked, and
it can lose the reply of a publish that did commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ckptless.errors import CkptlessError
from ckptless.mirror.placement import compute_placement
from ckptless.recovery.decision import Assignment, DiskFallback, RecoveryPlan
from ckptless.recovery.facts import PlanPolicy, ReplicaFact, Worker, WorkerReport
from ckptless.recovery.gather import plan_from_view
from ckptless.recovery.leader_machine import (
    INITIAL,
    Action,
    AskGrow,
    EndJob,
    Event,
    Fenced,
    LeaderConfig,
    NoteWaiting,
    Observed,
    OpenIncident,
    Planned,
    PlanFailed,
    Publish,
    Published,
    PublishRejected,
    RequestPlan,
    State,
    replacement_key,
    step,
)
from ckptless.recovery.view import ExitRecord, JobStatus, JobView, ReportRecord
from ckptless.recovery.wire import Membership

JOB = "job"
CFG = LeaderConfig(JOB, replicas=1, report_timeout_s=10, alive_report_timeout_s=40, replacement_timeout_s=30,
                   formation_timeout_s=20,
                   formation_extensions=2, node_grace_s=5, gone_node_report_grace_s=1, max_recoveries=50)


def initial_membership(world: int = 4, per_node: int = 2) -> Membership:
    return Membership(0, world, "h", 1, tuple(
        Assignment(r, f"n{r // per_node}/w{r % per_node}", f"n{r // per_node}", "survivor") for r in range(world)))


@dataclass
class World:
    """Ground truth the views are derived from; mutate it, then ``view()``."""

    membership: Membership = field(default_factory=initial_membership)
    exits: dict[int, ExitRecord] = field(default_factory=dict)
    nodes: set[str] = field(default_factory=lambda: {"n0", "n1"})
    reports: dict[int, ReportRecord] = field(default_factory=dict)
    ready: set[int] = field(default_factory=set)
    spares: list[Worker] = field(default_factory=list)
    status: JobStatus | None = None
    incidents: set[int] = field(default_factory=set)
    committed: int = 4
    snapshot_step: int | None = None
    published: list[RecoveryPlan | DiskFallback] = field(default_factory=list)
    lose_next_reply: bool = False
    fence_next: bool | None = None  # True: deposed; False: generation moved
    leader_gone: bool = False  # another agent leads (our lease lapsed): every write of ours is fenced out
    ported: bool = True
    spare_exits: dict[str, ExitRecord] = field(default_factory=dict)  # worker id -> a dead spare's record
    policy: PlanPolicy = field(default_factory=PlanPolicy)  # --lost-node (shrink: fewer ranks)
    can_host: bool = False  # every report says its state can run another rank's micro-batches (DDP)

    # --- facts ------------------------------------------------------------------------------
    def view(self) -> JobView:
        return JobView(self.membership, dict(self.exits), frozenset(self.nodes), dict(self.reports),
                       frozenset(self.ready), tuple(self.spares), self.status,
                       self.membership.generation in self.incidents, ported=self.ported,
                       worker_exits={**{r.worker_id: r for r in self.exits.values()}, **self.spare_exits})

    def worker(self, rank: int) -> str:
        return self.membership.worker_of(rank).worker_id

    def kill(self, rank: int, t: float = 0.0, sig: int = 9) -> None:
        a = self.membership.worker_of(rank)
        self.exits[rank] = ExitRecord(rank, a.worker_id, a.node_id, 100 + rank, None, sig, t)

    def user_error(self, rank: int, t: float = 0.0) -> None:
        from ckptless.recovery.view import ErrorSummary

        a = self.membership.worker_of(rank)
        self.exits[rank] = ExitRecord(rank, a.worker_id, a.node_id, 100 + rank, 1, None, t, kind="user_error",
                                      error=ErrorSummary("ValueError", "boom", "Traceback ..."))

    def finish(self, rank: int, t: float = 0.0) -> None:
        a = self.membership.worker_of(rank)
        self.exits[rank] = ExitRecord(rank, a.worker_id, a.node_id, 100 + rank, 0, None, t)

    def lose_node(self, node: str) -> None:
        self.nodes.discard(node)

    def holders(self) -> dict[int, tuple[int, ...]]:
        """The real (node-aware) K=1 ring placement of the initial layout."""
        node_of = [r // 2 for r in range(self.membership.world_size)]
        p = compute_placement(self.membership.world_size, 1, "ring", node_of)
        return {o: p.holders(o) for o in range(self.membership.world_size)}

    def report(self, rank: int, fresh: bool = False, reason: str = "peer failure") -> None:
        """Survivor facts at ``committed``: its own image locally, the images it holds by placement."""
        if fresh:
            rep = WorkerReport(self.worker(rank), None, None)
        else:
            held = tuple(ReplicaFact(o, self.committed, 3) for o, hs in sorted(self.holders().items()) if rank in hs)
            rep = WorkerReport(self.worker(rank), self.committed, self.committed, frozenset({self.committed}), held,
                               can_host=self.can_host)
        self.reports[rank] = ReportRecord(rep, reason)

    def report_all_alive(self) -> None:
        view = self.view()
        for a in self.membership.ranks:
            if view.current_exit(a.rank) is None and a.node_id in self.nodes:
                self.report(a.rank, fresh=a.source != "survivor" and a.rank not in self.ready)

    def ready_all(self) -> None:
        self.ready = {a.rank for a in self.membership.ranks}

    # --- the fake etcd side of actions -------------------------------------------------------
    def execute(self, action: Action, now: float) -> Event | None:
        if self.leader_gone and isinstance(action, (OpenIncident, EndJob, NoteWaiting, AskGrow)):
            return Fenced("fenced", now)
        if self.leader_gone and isinstance(action, Publish):
            return PublishRejected(False, "fenced", now)
        if isinstance(action, OpenIncident):
            self.incidents.add(action.generation)
        elif isinstance(action, EndJob):
            self.status = action.status
        elif isinstance(action, RequestPlan):
            try:
                decision, notes = plan_from_view(self.view(), JOB, action.lost, CFG.replicas, CFG.placement,
                                                 self.snapshot_step, self.policy)
                return Planned(decision, tuple(notes), now, replacement_key(self.view()))
            except CkptlessError as exc:
                return PlanFailed(str(exc), now)
        elif isinstance(action, Publish):
            if self.fence_next is not None:
                deposed, self.fence_next = self.fence_next, None
                return PublishRejected(not deposed, "fenced", now)
            self.publish(action.decision)
            if self.lose_next_reply:
                self.lose_next_reply = False
                return PublishRejected(True, "reply lost (the transaction did commit)", now)
            return Published(action.decision.generation, now)
        return None

    def publish(self, d: RecoveryPlan | DiskFallback) -> None:
        assert d.generation == self.membership.generation + 1, "generations advance by exactly one"
        self.published.append(d)
        self.membership = Membership(d.generation, self.membership.world_size, "h", 1, d.assignments, d)
        self.reports = {}
        self.ready = set()
        for a in d.assignments:  # spares that got a rank leave the pool
            self.spares = [s for s in self.spares if s.worker_id != a.worker_id]


@dataclass
class Leader:
    """Runs the machine against a World, executing actions until quiet (as the driver does)."""

    world: World
    state: State = INITIAL
    now: float = 0.0
    log: list[Action] = field(default_factory=list)

    def feed(self, event: Event) -> None:
        pending = [event]
        while pending:
            ev = pending.pop(0)
            self.state, actions = step(self.state, ev, CFG)
            self.log += actions
            for a in actions:
                follow = self.world.execute(a, self.now)
                if isinstance(follow, Fenced):  # as the driver: nothing else of this step runs
                    pending = [follow]
                    break
                if follow is not None:
                    pending.append(follow)

    def observe(self, dt: float = 0.0) -> State:
        self.now += dt
        self.feed(Observed(self.world.view(), self.now))
        return self.state

    def messages(self) -> str:
        return "\n".join(getattr(a, "message", "") for a in self.log)


def fresh_leader(**kw: object) -> Leader:
    w = World(**kw)  # type: ignore[arg-type]
    ld = Leader(w)
    ld.observe()
    return ld


def with_membership(w: World, **changes: object) -> World:
    w.membership = replace(w.membership, **changes)  # type: ignore[arg-type]
    return w
