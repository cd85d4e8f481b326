"""The node agent's decisions as one pure machine: ``step(node, event, now) -> (node, actions)``.

Why a machine: the agent decides which workers are killed, which ranks start
again here, when a pre-built spare restarts as its rank, and when (and with
which code) it leaves. Those decisions used to be taken on three threads (the
etcd watch, the reaper, the main loop) over a shared state bag, reading the
clock and etcd as they went, and no test reached them. Here, as with the
worker (``worker/machine.py``) and the leader (``recovery/leader_machine.py``),
every fact arrives as a typed event (the slot table's snapshot and, when the
machine needs them, the job's exit records ride on the event), the clock is
passed in, and every decision is an action the driver
(``launcher/node_driver.py``) carries out.

States (``Node``: one record; ``exit_code`` set is the terminal state)::

    Starting --Spawned--> Running --Tick: this node's part is over--> Left(code)
    Running --MembershipSeen--> Running (+ Kill / Assign / Respawn / Reexec)
    any --StopRequested--> (next Tick) Left(128 + N)
    any --StatusSeen(failed)--> (next Tick) Left(1)

Every wait has a way out: the store's host waiting for the other nodes' exit
records leaves once they are all in, once the job's status says it ended, or
once etcd has been gone past ``node_grace + lease_ttl`` (a finished job never
exits non-zero); a node cut off from etcd past that grace with no worker left
leaves with 1; a pre-built spare waiting to restart as its rank waits for the
membership that assigns it (the leader re-plans it if that never comes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

from ckptless.launcher.node_actions import (  # re-exported: the machine's outputs, named from here too
    Action, Assign, Exit, Kill, Log, NoteGeneration, NoteIncident, Reexec, RefillWaitsForGpu, RemoveDeadShm, Say,
    SendStatus, StartRespawn, StartSpare, TouchHeartbeat)
from ckptless.launcher.node_rules import (
    Heartbeat, all_ranks_finished, frozen, node_part, recovery_over, spares_missing, startup_grace_s)
from ckptless.launcher.slots import Slot, slot_for_rank
from ckptless.recovery import Assignment
from ckptless.recovery import ExitRecord, JobStatus
from ckptless.recovery import Membership

__all__ = ["Heartbeat", "all_ranks_finished", "node_part", "recovery_over", "spares_missing",  # launcher/node_rules.py
           "startup_grace_s",
           "Action", "Assign", "Exit", "Kill", "Log", "NoteGeneration", "NoteIncident", "Reexec", "RefillWaitsForGpu",
           "RemoveDeadShm", "Say", "SendStatus", "StartRespawn", "StartSpare", "TouchHeartbeat"]

#: How long a respawn waits for the process it replaces to be reaped (a SIGKILLed one: milliseconds).
REAP_WAIT_S = 10.0


@dataclass(frozen=True)
class NodeConfig:
    """What the machine knows of this node and its flags (fixed once the job formed)."""

    node_id: str
    host: str  # this node's TCPStore: the store's host waits for the others before it leaves
    store_port: int
    node_grace_s: float = 10.0
    lease_ttl_s: float = 10.0
    recovery: bool = True  # off: the first failure ends the job, as with torchrun
    shm: bool = False  # --shm-dir: node-local replicas to clear when a node is lost
    rank_offset: int = 0  # this node's first rank (where a rank respawns: launcher/slots.py, slot_for_rank)
    spares: int = 0  # --spares: how many this node keeps
    spare_refill: bool = False  # --spare-refill: a new spare for each of ours that took a rank
    hang_timeout_s: float | None = None  # --hang-timeout: a rank without a heartbeat this long is frozen
    shutdown_timeout_s: float = 30.0  # --shutdown-timeout: a teardown longer than this after the program ended


@dataclass(frozen=True)
class WaitingRespawn:
    """A rank to start again in ``local_rank`` once the worker still there exits (its exit is recorded under
    its own worker id first), or never if it has not by ``deadline``."""

    local_rank: int
    assignment: Assignment
    generation: int
    deadline: float
    replaces: str  # the worker id still in the slot


@dataclass(frozen=True)
class Node:
    cfg: NodeConfig
    membership: Membership | None = None  # the newest generation this agent follows
    status: JobStatus | None = None  # the job's end, once etcd (or this agent) recorded one
    stop_signal: int | None = None
    spawned: bool = False  # the worker group exists (a membership seen before only records the generation)
    lost_since: float | None = None  # our lease was found lost then and has not been renewed since
    lease_lapsed_at: float | None = None  # when our lease was last found lost (kept after a renewal)
    reexec_pending: frozenset[int] = frozenset()  # local ranks of pre-built spares to restart as their rank
    incidents: frozenset[int] = frozenset()  # generations whose incident this agent has seen opened
    local_failures: tuple[ExitRecord, ...] = ()  # this node's ranks' failures (the summary at the end)
    respawns: tuple[WaitingRespawn, ...] = ()  # respawns waiting for the worker they replace to exit
    refills_owed: int = 0  # --spare-refill: spares of ours that took a rank, not replaced yet
    refills_started: int = 0  # refills started so far (names the next one)
    refill_gpu_warned: bool = False  # "no free GPU for a refill" is said once
    killed_in_teardown: frozenset[int] = frozenset()  # pids killed stuck in their teardown (each once)
    exit_code: int | None = None  # set: this agent is done (terminal)


# --- events -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spawned:
    """The worker group exists: from now on a membership moves slots."""


@dataclass(frozen=True)
class MembershipSeen:
    membership: Membership
    slots: tuple[Slot, ...]  # the slot table when it arrived (read under the driver's lock)


@dataclass(frozen=True)
class StatusSeen:
    status: JobStatus  # a malformed record arrives as a failed status (the reader says so)


@dataclass(frozen=True)
class IncidentSeen:
    generation: int
    waiting_since: float | None  # the leader noted the job waits for a node since then


@dataclass(frozen=True)
class ExitRecorded:
    """A worker's exit record was written (launcher/exit_records.py); ``ranked``: it ran a rank."""

    local_rank: int
    record: ExitRecord
    ranked: bool
    succeeded: bool
    requested: bool


@dataclass(frozen=True)
class ReexecAsked:
    """A pre-built spare exited to start again as the rank it was given."""

    local_rank: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class StopRequested:
    signum: int


@dataclass(frozen=True)
class LeaseLost:
    """Our lease is gone (paused, or etcd away) and a renewal is being tried."""


@dataclass(frozen=True)
class LeaseRenewed:
    pass


@dataclass(frozen=True)
class Tick:
    """A turn of the main loop. ``exits``: the job's exit records, read when :func:`wants_exits` said the
    decision needs them (None: not read, or etcd did not answer)."""

    slots: tuple[Slot, ...]
    exits: tuple[ExitRecord, ...] | None = None
    # The heartbeat records of this node's live ranks (heartbeat file -> record), read when
    # :func:`wants_progress` said a refill decision needs them; whether a new spare would find a GPU.
    progress: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    gpu_free: bool = True


@dataclass(frozen=True)
class HeartbeatsRead:
    beats: tuple[Heartbeat, ...]


@dataclass(frozen=True)
class TeardownsStuck:
    """Live workers whose program declared its end (``(local rank, pid, code, seconds since)``) more than
    ``--shutdown-timeout`` ago (launcher/watchdog.py, stuck_in_teardown)."""

    stuck: tuple[tuple[int, int, int, float], ...]


@dataclass(frozen=True)
class SpareDeferred:
    """A refill's start found etcd away before it claimed anything: the refill stays owed (next turn)."""

    worker_id: str


Event = Union[Spawned, MembershipSeen, StatusSeen, IncidentSeen, ExitRecorded, ReexecAsked, StopRequested,
              LeaseLost, LeaseRenewed, Tick, SpareDeferred, HeartbeatsRead, TeardownsStuck]
Step = tuple[Node, tuple[Action, ...]]


def step(node: Node, event: Event, now: float) -> Step:
    """The whole agent's decisions: pure, total over (node, event). A node that left ignores everything."""
    if isinstance(event, StatusSeen):  # kept after the end too: a failed job's summary names it
        return replace(node, status=event.status), ()
    if node.exit_code is not None:
        return node, ()
    if isinstance(event, MembershipSeen):
        return _membership(node, event, now)
    if isinstance(event, IncidentSeen):
        first = event.generation not in node.incidents
        return (replace(node, incidents=node.incidents | {event.generation}),
                (NoteIncident(event.generation, first, event.waiting_since),))
    if isinstance(event, ExitRecorded):
        return _exit_recorded(node, event)
    if isinstance(event, ReexecAsked):
        return _reexec_assigned(replace(node, reexec_pending=node.reexec_pending | {event.local_rank}),
                                {s.local_rank: s for s in event.slots})
    if isinstance(event, Spawned):
        return replace(node, spawned=True), ()
    if isinstance(event, StopRequested):
        return (node, ()) if node.stop_signal is not None else (replace(node, stop_signal=event.signum), ())
    if isinstance(event, LeaseLost):
        if node.lost_since is not None:
            return node, ()
        return replace(node, lost_since=now, lease_lapsed_at=now), ()
    if isinstance(event, LeaseRenewed):
        return replace(node, lost_since=None), ()
    if isinstance(event, Tick):
        return _tick(node, event, now)
    if isinstance(event, HeartbeatsRead):
        return node, _frozen(node.cfg, event.beats)
    if isinstance(event, TeardownsStuck):
        return _stuck(node, event)
    if isinstance(event, SpareDeferred):
        return replace(node, refills_owed=node.refills_owed + 1, refills_started=node.refills_started - 1), ()
    raise TypeError(f"not a node event: {event!r}")


# --- following a membership ---------------------------------------------------------------------------------
def _membership(node: Node, ev: MembershipSeen, now: float) -> Step:
    """Follow a new generation: adopt assigned spares, respawn here, kill the dropped."""
    m = ev.membership
    if node.membership is not None and m.generation <= node.membership.generation:
        return node, ()
    node = replace(node, membership=m)
    acts: list[Action] = [NoteGeneration(m.generation)]
    if not node.spawned:
        return node, tuple(acts)
    # A hosted rank's entry names its host (fewer ranks): the host's slot keeps its own rank.
    by_worker = {a.worker_id: a for a in m.ranks if a.source != "hosted"}
    after: dict[int, Slot] = {}
    for slot in ev.slots:
        a = by_worker.get(slot.worker_id)
        rank = slot.rank
        if a is not None:
            if slot.spare and slot.alive and node.cfg.spare_refill:
                node = replace(node, refills_owed=node.refills_owed + 1)  # the pool owes one
            acts.append(Assign(slot.local_rank, a.rank))
            rank = a.rank
        elif slot.rank is not None:
            if slot.alive:
                acts.append(Kill(slot.local_rank, f"worker {slot.worker_id} is not part of generation "
                                                  f"{m.generation}: killing it"))
            acts.append(Assign(slot.local_rank, None))  # its rank now runs elsewhere
            rank = None
        after[slot.local_rank] = replace(slot, rank=rank)
    # A respawn still waiting from an older generation starts only if this one still names its worker, and
    # never in a slot this one gives another respawn (two threads once raced for one slot there).
    named = {a.worker_id for a in m.ranks}
    waiting = [w for w in node.respawns if w.assignment.worker_id in named]
    for a in m.ranks:
        if a.node_id != node.cfg.node_id or a.source != "respawn":
            continue
        target = slot_for_rank(list(after.values()), a.rank, node.cfg.rank_offset)
        if target is None or target.worker_id == a.worker_id:
            continue
        waiting = [w for w in waiting if w.local_rank != target.local_rank]
        if target.alive:  # its exit is recorded under its own worker id first: then it starts (ExitRecorded)
            waiting.append(WaitingRespawn(target.local_rank, a, m.generation, now + REAP_WAIT_S, target.worker_id))
        else:
            acts.append(StartRespawn(target.local_rank, a, m.generation))
        after[target.local_rank] = replace(target, worker_id=a.worker_id, rank=a.rank)  # taken: not the next one's
    node, reexecs = _reexec_assigned(replace(node, respawns=tuple(waiting)), after)
    acts += reexecs
    if node.cfg.shm:
        acts.append(RemoveDeadShm())
    return node, tuple(acts)


def _reexec_assigned(node: Node, slots: Mapping[int, Slot]) -> Step:
    """Each pending pre-built spare whose slot holds a rank in the membership we follow restarts as it;
    the others wait for the membership that assigns them (the next MembershipSeen looks again)."""
    m = node.membership
    if m is None or not node.spawned:
        return node, ()
    acts: list[Action] = []
    pending = set(node.reexec_pending)
    for lr in sorted(node.reexec_pending):
        slot = slots.get(lr)
        if slot is None or slot.rank is None:
            continue
        pending.discard(lr)
        acts.append(Reexec(lr, slot.worker_id, slot.rank, m.generation))
    return replace(node, reexec_pending=frozenset(pending)), tuple(acts)


def _exit_recorded(node: Node, ev: ExitRecorded) -> Step:
    """A respawn waiting for this slot starts now; a failure of one of our ranks is kept for the summary;
    without recovery it ends the job, as with torchrun (the first writer of the status wins)."""
    ready = [w for w in node.respawns if w.local_rank == ev.local_rank]
    acts: tuple[Action, ...] = tuple(StartRespawn(w.local_rank, w.assignment, w.generation) for w in ready)
    if ready:
        node = replace(node, respawns=tuple(w for w in node.respawns if w.local_rank != ev.local_rank))
    if ev.succeeded or ev.requested or not ev.ranked:
        return node, acts
    node = replace(node, local_failures=node.local_failures + (ev.record,))
    if node.cfg.recovery or ev.record.outcome == "other":
        return node, acts
    status = JobStatus("failed", ev.record.describe(), ev.record)
    return replace(node, status=node.status or status), acts + (SendStatus(status),)


# --- the watchdog: frozen ranks, stuck teardowns -----------------------------------------------------------------
def _frozen(cfg: NodeConfig, beats: Sequence[Heartbeat]) -> tuple[Action, ...]:
    """SIGKILL each frozen rank (launcher/node_rules.py, frozen): it becomes the crash its peers detect in
    milliseconds."""
    acts: list[Action] = []
    for b in frozen(cfg.hang_timeout_s, beats):
        acts += [Kill(b.local_rank, f"rank {b.rank} ({b.worker_id}) is frozen (no heartbeat for {b.age_s:.1f}s): "
                                    "SIGKILL", "error"), TouchHeartbeat(b.heartbeat_file)]
    return tuple(acts)


def _stuck(node: Node, ev: TeardownsStuck) -> Step:
    """SIGKILL each worker stuck in its teardown, once, with one line (an atexit hook or a destructor at exit
    waiting on a peer that is gone would hold its agent, and the job, forever: issue 35)."""
    acts: list[Action] = []
    killed = set(node.killed_in_teardown)
    grace = node.cfg.shutdown_timeout_s
    for lr, pid, code, since in ev.stuck:
        if pid in killed:
            continue
        killed.add(pid)
        acts.append(Kill(lr, f"local rank {lr} (pid {pid}) ended its program with code {code} {since:.0f}s ago and is "
                             "still in its teardown (an atexit hook or a destructor at exit, --shutdown-timeout "
                             f"{grace:.0f}s): SIGKILL; its exit is recorded as code {code}", "error", teardown_pid=pid))
    return replace(node, killed_in_teardown=frozenset(killed)), tuple(acts)


# --- when to leave --------------------------------------------------------------------------------------------
def my_ranks(node: Node) -> dict[int, str]:
    """The ranks the membership this agent follows places on this node, with their worker ids."""
    m = node.membership
    if m is None:
        return {}
    return {a.rank: a.worker_id for a in m.ranks if a.node_id == node.cfg.node_id and a.source != "hosted"}


def hosts_store(node: Node) -> bool:
    """This agent hosts the current generation's store (others may still need it to finish)."""
    m = node.membership
    return m is not None and m.store_port == node.cfg.store_port and m.store_host == node.cfg.host


def wants_exits(node: Node, slots: Sequence[Slot]) -> bool:
    """Whether the next Tick's decision reads the job's exit records (one etcd read: only then)."""
    if node.exit_code is not None or node.stop_signal is not None or node.membership is None:
        return False
    if node.status is not None and node.status.state == "failed":
        return False
    part = node_part(slots, my_ranks(node))
    return (part == "finished" and hosts_store(node)) or part in ("spare_only", "spares")


def _tick(node: Node, ev: Tick, now: float) -> Step:
    late = [w for w in node.respawns if now >= w.deadline]
    if late:  # every wait has a deadline: a worker that never exits is not replaced here
        node = replace(node, respawns=tuple(w for w in node.respawns if now < w.deadline))
    gave_up = tuple(Log("error", f"rank {w.assignment.rank}: the worker it replaces ({w.replaces}) did not exit; "
                                 "not respawning") for w in late)
    node, refill = _refill(node, ev)
    node, acts = _tick_exit(node, ev, now)
    return node, gave_up + refill + acts


# --- --spare-refill ---------------------------------------------------------------------------------------------
def wants_progress(node: Node) -> bool:
    """Whether the next Tick's refill decision reads this node's heartbeat records (only while one is owed
    and nothing else holds it back)."""
    m = node.membership
    return (node.refills_owed > 0 and m is not None and node.stop_signal is None and node.status is None
            and node.exit_code is None and m.generation not in node.incidents)


def _refill(node: Node, ev: Tick) -> Step:
    """Start a new spare once one of ours took a rank and that recovery is over: every rank this node runs
    trains again in the generation that took the spare (their heartbeats say so), so the new spare's setup
    never competes with the recovery itself; another failure meanwhile waits for its recovery too."""
    m = node.membership
    if not wants_progress(node) or m is None or not recovery_over(ev.slots, m.generation, ev.progress.get):
        return node, ()
    claimed = replace(node, refills_owed=node.refills_owed - 1, refills_started=node.refills_started + 1)
    if spares_missing(ev.slots, node.cfg.spares) == 0:
        return claimed, ()  # the pool is full (e.g. a slot came back): nothing owed
    if not ev.gpu_free:  # still owed: a GPU may free up (a rank that moved away)
        if node.refill_gpu_warned:
            return node, ()
        return replace(node, refill_gpu_warned=True), (RefillWaitsForGpu(),)
    worker_id = f"{node.cfg.node_id}/spare{node.cfg.spares + node.refills_started}"
    return claimed, (StartSpare(worker_id, m.world_size, m.store_host, m.store_port),)


def _tick_exit(node: Node, ev: Tick, now: float) -> Step:
    code, acts = _exit_code(node, ev, now)
    if code is None:
        return node, acts
    sent = [a.status for a in acts if isinstance(a, SendStatus)]
    # Nothing waits once the node left (its workers are stopped next): no respawn starts after the end.
    return (replace(node, exit_code=code, status=node.status or (sent[0] if sent else None), respawns=()),
            acts + (Exit(code),))


def _exit_code(node: Node, ev: Tick, now: float) -> tuple[int | None, tuple[Action, ...]]:
    """A stop signal exits 128+N; a job that failed exits 1; a node whose ranks all finished exits 0 -- but
    the store's host waits for the other nodes' exit records first (they may still need its store), and not
    on an etcd that is gone: a finished job never exits non-zero (a scheduler reads that as a failed job)."""
    if node.stop_signal is not None:
        return 128 + node.stop_signal, ()
    status = node.status
    if status is not None and status.state == "failed":
        return 1, ()
    slots, m = ev.slots, node.membership
    part = node_part(slots, my_ranks(node))
    gone = _etcd_gone_past_grace(node, now)
    if part == "finished":
        if not hosts_store(node):
            return 0, ()
        if all_ranks_finished(m, ev.exits):
            return 0, _record_success(node)
        if gone:
            return 0, (Say("ckptless-run: this node's ranks all finished the job; etcd has been unreachable for "
                           f"{now - (node.lost_since or 0.0):.0f}s, so the other nodes' exit records cannot be "
                           "read: leaving with success"),)
    if status is not None and status.state == "succeeded":
        return 0, ()
    if part in ("spare_only", "spares") and all_ranks_finished(m, ev.exits):
        return 0, ()  # a node that only keeps spares outlives nobody
    if part == "moved" and not hosts_store(node):
        return 1, (_say_moved(node, slots),)
    if any(s.ever_ranked for s in slots) and gone and not any(s.alive for s in slots if s.rank is not None):
        # Cut from etcd past the node grace with none of our workers left: the job went on without us
        # (while etcd is merely down for everyone, our workers keep training and we stay).
        return 1, (Say(f"ckptless-run: this node was cut off from etcd for {now - (node.lost_since or 0.0):.0f}s "
                       f"(more than --node-grace {node.cfg.node_grace_s:.0f}s) and its workers have ended: its "
                       "ranks were re-planned elsewhere; leaving"),)
    return None, ()


def _record_success(node: Node) -> tuple[Action, ...]:
    """The store's host, the last to leave, records the job's success unless the leader did already (the
    leader's agent may leave first): an agent started after the job reads it and exits 0 at once
    (launcher/admission.py) instead of waiting for a round of its own. Only with recovery: a relaunch
    clears the old run's records only then (recovery/leader.py, write_initial_membership), and a job
    without recovery would otherwise find its last run's success and end at once."""
    # Note: a job that ended shrunk (--lost-node shrink, never grown back) says "all N ranks finished" of
    # its last generation's N, though the others wrote no final state (issue 35 finding 9).
    if node.cfg.recovery and node.status is None and node.membership is not None:
        return (SendStatus(JobStatus("succeeded", f"all {node.membership.world_size} ranks finished")),)
    return ()


def _say_moved(node: Node, slots: Sequence[Slot]) -> Say:
    """One line: why this agent leaves while its job goes on (exit 1: this node failed the job)."""
    m = node.membership
    ran = sorted({r for s in slots for r in (s.rank, s.last_rank) if r is not None})
    why = ("this agent lost its lease (paused, or cut off from etcd) and the coordinator gave the node up "
           f"after --node-grace {node.cfg.node_grace_s:.0f}s" if node.lease_lapsed_at is not None
           else "the coordinator re-planned them")
    return Say(f"ckptless-run: this node's ranks {ran} run on other nodes since generation "
               f"{m.generation if m is not None else '?'} ({why}), and it keeps no spare: leaving; the job goes "
               "on without this node")


def _etcd_gone_past_grace(node: Node, now: float) -> bool:
    lost = node.lost_since
    return lost is not None and now - lost > node.cfg.node_grace_s + node.cfg.lease_ttl_s
