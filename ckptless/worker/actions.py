"""Executors of the worker machine's actions: the I/O of a worker's life.

Why a module of its own: :mod:`ckptless.worker.machine` decides, the
executors do (etcd, groups, transfers, the training loop), and each turns
its outcome into exactly one event. They act on the driver's
:class:`~ckptless.worker.runtime.WorkerRuntime` only, never on the user's
``Job``. This module dispatches and holds the membership side (wait, adopt,
form, mark ready); :mod:`ckptless.worker.restoring` the state side;
:mod:`ckptless.worker.training` the step loop. Every executor catches what
its layer raises and types it: a failure of the transport is a ``Fault``
(recover), an error in the user's step is a ``UserError`` (fail fast), a
deterministic local problem is ``Internal``. Failures are turned into events
*outside* ``except`` blocks: a live traceback pins the broken communicator's
sockets and keeps peers blocked.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from ckptless.environment import export
from ckptless.errors import CoordinatorUnavailable, IntegrityError, RecoveryError, TransportError
from ckptless.goodput import EventKind
from ckptless.recovery import Membership
from ckptless.worker import adoption, ahead, groups, restoring, training
from ckptless.worker.control import JobEndedError
from ckptless.worker.generation import Generation
from ckptless.worker.mirror_peers import mirror_peers
from ckptless.worker.machine import (
    Action,
    AwaitMembership,
    CoordinatorLost,
    Event,
    Exit,
    FormFailed,
    Formed,
    FormGroups,
    JobEnded,
    LeaveGroups,
    MarkReady,
    MembershipSeen,
    Report,
    RestoreState,
    TimedOut,
    Train,
    WaitFinalCommit,
)
from ckptless.worker.runtime import KEEP, Changed, Keep, ReportNotes, WorkerRuntime

log = logging.getLogger(__name__)


def execute(rt: WorkerRuntime, action: Action) -> Changed:
    """Carry ``action`` out: the event it ends with and what it changed (the driver applies it)."""
    if isinstance(action, AwaitMembership):
        return Changed.of(_await(rt, action))
    if isinstance(action, FormGroups):
        return _form(rt, action)
    if isinstance(action, RestoreState):
        return restoring.restore_state(rt, action)
    if isinstance(action, MarkReady):
        return Changed(_mark_ready(rt, action))
    if isinstance(action, Train):
        return Changed.of(training.train(rt, action.generation, action.from_step, action.until_reprotected))
    if isinstance(action, WaitFinalCommit):
        return Changed(training.final_commit(rt))
    if isinstance(action, LeaveGroups):
        return restoring.leave(rt, action)
    if isinstance(action, Report):
        return Changed(restoring.report(rt, action))
    if isinstance(action, Exit):
        return Changed(None)  # the machine is terminal; the driver leaves the way the state says
    raise TypeError(f"unknown action {action!r}")


# --- membership -----------------------------------------------------------------------------------
def _await(rt: WorkerRuntime, a: AwaitMembership) -> Event | Changed:
    assert rt.control is not None
    try:
        m = rt.control.wait_membership(a.after, a.deadline)
    except JobEndedError as exc:
        return JobEnded(exc.status.reason)
    except CoordinatorUnavailable as exc:
        return CoordinatorLost(str(exc))
    now = time.monotonic()
    if m is None:
        return TimedOut(now)
    includes = m.rank_of(rt.worker_id) is not None
    seen = MembershipSeen(m.generation, includes, m.decision is not None, now)
    return Changed(seen, adopt=m) if includes else seen  # the driver adopts it (admit, rt.seen, adopted)


def admit(rt: WorkerRuntime, m: Membership) -> bool:
    """Before the driver adopts a membership that includes us: a spare whose setup cannot serve the rank it is
    assigned re-executes as that rank (the process ends here). True: a pre-built spare takes another rank as
    built (:func:`adopted` re-makes what its setup made for its standby rank)."""
    first = rt.seen is None
    assigned = m.rank_of(rt.worker_id)
    other_rank = rt.prebuilt and first and assigned != rt.ctx.standby_rank
    if other_rank:
        why = "it is not in the plan" if assigned is None else adoption.why_not(rt.registry, m, assigned)
        if why is not None:
            log.warning("spare %s cannot take rank %s as built: %s", rt.worker_id, assigned, why)
            adoption.reexec(rt, assigned)
    elif first and rt.ctx.role == "spare" and not rt.prebuilt and assigned is not None:
        why = adoption.why_not_waited(rt, assigned)
        if why is not None:
            log.warning("spare %s cannot take rank %s in this process: %s", rt.worker_id, assigned, why)
            adoption.reexec(rt, assigned)
    return other_rank


def adopted(rt: WorkerRuntime, m: Membership, first: bool, other_rank: bool) -> None:
    """The driver adopted ``m`` (``rt.seen``): take its rank (a spare learns it now) and make the default group."""
    assigned = m.rank_of(rt.worker_id)
    if other_rank:
        assert assigned is not None
        log.warning("spare %s built as rank %s takes rank %d as built (same layout): no re-exec, no setup",
                    rt.worker_id, rt.ctx.standby_rank, assigned)
        adoption.take_rank(rt, assigned, m.world_size)
    rank = rt.rank
    if first and rt.ctx.role == "spare":
        export({"RANK": str(rank), "WORLD_SIZE": str(m.world_size)})  # the script may read them from now on
    rt.ledger.set_rank(rank)
    if first and rt.ctx.role == "spare":  # its start had no rank to be written under: the report's
        rt.ledger.emit(EventKind.JOB_START, generation=m.generation, role="spare")  # "replacement ready"
    started = time.monotonic()
    try:
        store = rt.store_for(m)
        connected = time.monotonic()
        groups.ensure_default_group(store, rank, m.world_size, rt.ctx.collective_timeout_s)
        if first:
            rt.ledger.emit(EventKind.MEMBERSHIP_ADOPTED, generation=m.generation,
                           store_s=round(connected - started, 4), group_s=round(time.monotonic() - connected, 4))
    except TransportError as exc:
        # The generation's store went with its host (the leader's node lost just after it published, issue
        # 35): forming this generation fails the usual way and the next membership is awaited. Raised
        # from here, it escaped the script as an exit without a record: a "user error" that ended the job.
        rt.forget_store()
        log.warning("%s: generation %d's store is unreachable (%s); forming it will fail", rt.worker_id,
                    m.generation, exc)


def _form(rt: WorkerRuntime, a: FormGroups) -> Changed:
    m = rt.seen
    assert m is not None and m.generation == a.generation
    try:
        store, unreachable = rt.store_for(m), ""
    except TransportError as exc:  # its host is gone (the leader's node, lost after it published): a failed
        store, unreachable = None, str(exc)  # formation, not an exception out of the script
    gen = Generation(m, rt.worker_id, store)
    if unreachable:
        rt.forget_store()
        return Changed(FormFailed(unreachable), gen=gen)
    restoring.roll_back_early(rt, gen)
    reason = ""
    phases: dict[str, float] = {}
    notes: ReportNotes | Keep = KEEP
    # The transfers a replacement started during its setup are taken by this formation, whatever it does.
    taken: Changed = Changed(gen=gen, transfer_ahead=None) if ahead.takes_ahead(rt, m) else Changed(gen=gen)
    try:
        started = time.monotonic()
        ahead.run_or_collect(rt, gen, a.deadline)
        phases["ahead_s"] = round(time.monotonic() - started, 4)
        physical = gen.physical  # fewer ranks: the communicators span this generation's processes
        gen.mirror_group = groups.bind_all(gen.store, m.generation, gen.rank, gen.world_size,  # type: ignore[arg-type]
                                           rt.ctx.collective_timeout_s, a.deadline,
                                           lambda: ahead.abort_reason(rt, m.generation),
                                           () if physical is not None else
                                           mirror_peers(m, gen.rank, rt.replicas, rt.mirror_config.placement),
                                           physical=physical, phases=phases)
    except TransportError as exc:
        reason = str(exc)
    except (IntegrityError, RecoveryError) as exc:  # from the transfers run ahead
        reason = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, IntegrityError):
            notes = rt.notes.failed(exc)
    if reason:
        rt.forget_store()  # a broken client never recovers (a partition, a store restart): connect anew
        return replace(taken, event=FormFailed(reason), notes=notes)
    gen.bound = True
    if m.decision is not None:
        rt.ledger.emit(EventKind.GROUPS_REFORMED, generation=m.generation, ahead_s=phases.get("ahead_s", 0.0),
                       arrive_s=phases.get("arrive_s", 0.0), connect_s=phases.get("connect_s", 0.0))
    return replace(taken, event=Formed(m.generation, -1))


def _mark_ready(rt: WorkerRuntime, a: MarkReady) -> Event | None:
    if rt.control is None:
        return None
    try:
        rt.control.mark_ready(a.generation, rt.rank)
    except CoordinatorUnavailable as exc:
        return CoordinatorLost(str(exc))
    return None
