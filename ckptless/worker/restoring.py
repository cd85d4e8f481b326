"""Executors of a recovery's state side: roll back early, restore, leave, report.

Why a module of its own: these are the steps where a worker's protected
state changes hands (its own committed image, a peer's replica, a disk
snapshot), with their own failure typing: a bad transfer or snapshot is
re-planned (``RestoreFailed``), an image that cannot fit the script's objects
ends the worker (``Internal``). The decisions live in
:mod:`ckptless.recovery.executor` (explicit inputs, typed outcome); this
module builds those inputs from the runtime and records the outcome.
"""

from __future__ import annotations

import faulthandler
import logging
import time
from dataclasses import replace

from ckptless.errors import (
    CoordinatorUnavailable,
    DeviceTimeout,
    IntegrityError,
    RecoveryError,
    SnapshotError,
    StateError,
    TransportError,
    UnrecoverableError,
)
from ckptless.goodput import EventKind
from ckptless.mirror import MISSING
from ckptless.recovery import (RestoreInputs, SnapshotLoadFailed, adopt_copies, apply_decision,
                                        build_report, restore_early)
from ckptless.recovery import DiskFallback, RecoveryPlan
from ckptless.state import StateImage, StateRegistry, clear_grads, restore
from ckptless.worker import groups, hosted, reuse
from ckptless.worker.generation import Generation
from ckptless.worker.machine import (
    CoordinatorLost,
    Event,
    Internal,
    LeaveGroups,
    Left,
    Report,
    Reported,
    RestoreFailed,
    RestoreState,
    Restored,
)
from ckptless.worker.runtime import KEEP, Changed, ReportNotes, WorkerRuntime
from ckptless.worker.training import protect

log = logging.getLogger(__name__)


def _inputs(rt: WorkerRuntime, gen: Generation) -> RestoreInputs:
    return RestoreInputs(gen.membership, rt.worker_id, rt.registry, rt.own_images, rt.peer_store,
                         rt.ctx.collective_timeout_s, rt.ctx.job_id, rt.ctx.snapshot_dir,
                         restore_fn=_restore_locally,
                         shm_dir=rt.ctx.shm_dir if rt.mirror_config.node_local else None,
                         node_id=rt.ctx.node_id, into=rt.standby_buffers[0] if rt.standby_buffers else None,
                         own_images_trusted=engine_pool_in_memory(rt),
                         restored_early=gen.restored_early, transfers_done=gen.transfers_done,
                         received_early=gen.received, trained=rt.trained,
                         replica_dir=rt.ctx.shm_dir or None)


def roll_back_early(rt: WorkerRuntime, gen: Generation) -> None:
    """A survivor that resumes from its own image rolls back while the generation forms (it waits
    for every rank there anyway; a respawn runs its setup first). Best effort: on any error the
    restore after the formation does it, and reports it, the usual way."""
    if gen.decision is None or not rt.own_images:
        return
    try:
        gen.restored_early = restore_early(gen.decision, _inputs(rt, gen))
    except Exception as exc:  # noqa: BLE001 - the restore after the formation raises it, typed, if it recurs
        log.info("rank %d: early rollback skipped (%s); restoring after the formation", rt.rank, exc)


def _start_hosting(rt: WorkerRuntime, gen: Generation, version: int, notes: ReportNotes) -> Changed:
    """Take over the lost ranks this process hosts: their rank-bound state of ``version`` from the copies
    of their images it holds (the plan chose it for that: recovery/shrink.py). The event is None when it
    took them over (``micro``: what runs their micro-batches); ``notes``: the report's notes after the restore."""
    ranks = []
    names = hosted.rank_bound(rt.registry)
    plan = gen.decision
    if gen.hosted and rt.ctx.shm_dir:
        rt.open_peer_store()  # a respawn that hosts: its predecessor's replicas, re-attached from its node
    if isinstance(plan, RecoveryPlan) and plan.adoptions:  # R11: copies its node kept, taken first
        try:
            adopt_copies(plan, rt.worker_id, rt.peer_store, rt.ctx.shm_dir or None, rt.ctx.job_id, rt.ctx.node_id)
        except IntegrityError as exc:
            return Changed(RestoreFailed(f"cannot take a node-local copy to host from: {exc}"),
                           notes=notes.failed(exc))
    for r in gen.hosted:
        held = rt.peer_store.get(r, version) if rt.peer_store is not None else None
        if held is None:
            return Changed(RestoreFailed(f"rank {r}'s image of version {version}, which this rank was to host it "
                                         "from, is no longer held"))
        try:
            ranks.append(hosted.from_image(held.manifest, held.buffer, names))
        except StateError as exc:
            return Changed(Internal(f"cannot host rank {r}: {exc}"))
    if ranks:
        return Changed(micro=hosted.MicroBatches(rt.registry, rt.rank, gen.world_size, ranks,
                                                 hosted.ddp_modules(rt.registry), groups.local_only))
    return Changed()


def restore_state(rt: WorkerRuntime, a: RestoreState) -> Changed:
    gen = rt.gen
    assert gen is not None and gen.decision is not None
    inputs = _inputs(rt, gen)
    gen.restored_early = gen.received = None
    reason, internal, bad_snapshot = "", "", None
    failed_by: BaseException | None = None
    try:
        if isinstance(gen.decision, DiskFallback):
            with groups.local_only():  # a disk load moves no bytes between ranks
                out = apply_decision(gen.decision, inputs)
        else:
            out = apply_decision(gen.decision, inputs)
    except SnapshotLoadFailed as exc:
        bad_snapshot = exc.step
        reason = str(exc)
    except (TransportError, IntegrityError, SnapshotError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        failed_by = exc
    except (StateError, UnrecoverableError, RecoveryError) as exc:
        internal = f"cannot restore generation {a.generation}'s state: {type(exc).__name__}: {exc}"
    if internal:
        return Changed(Internal(internal))
    if reason:  # the next report re-reads every replica (and names a snapshot or a node copy that failed)
        return Changed(RestoreFailed(reason), notes=rt.notes.failed(failed_by, bad_snapshot))
    # Restored: the notes start afresh, the timeline goes on from here (a later fall-back counts from it).
    restored = Changed(notes=ReportNotes(), trained=out.resume_step, recovered=True)
    g = a.generation
    if out.source == "disk":
        lost = out.steps_lost
        if g == 0 and rt.ledger.last_step_before is not None:  # a whole-job restart: the previous run's work
            lost = max(0, rt.ledger.last_step_before - out.resume_step)
            log.warning("rank %d: resumed from the disk snapshot of step %d; %d steps of the previous run lost",
                        rt.rank, out.resume_step, lost)
        rt.ledger.emit(EventKind.DISK_RESTORE, step=out.resume_step, generation=g, steps_lost=lost)
    else:
        rt.ledger.emit(EventKind.TRANSFER_DONE, generation=g, bytes=out.bytes_received,
                       replica_bytes=out.bytes_from_replicas)
        rt.ledger.emit(EventKind.ROLLBACK_DONE, step=out.resume_step, generation=g, source=out.source)
    if gen.physical is not None:  # fewer ranks: no mirroring in this generation; host the lost ranks
        hosting = _start_hosting(rt, gen, out.resume_step, ReportNotes())
        restored = replace(restored, micro=hosting.micro, notes=hosting.notes if hosting.notes is not KEEP
                           else ReportNotes())
        if hosting.event is not None:
            return replace(restored, event=hosting.event)
        log.warning("rank %d: resumed at step %d in generation %d with %d processes for %d ranks%s", rt.rank,
                    out.resume_step, g, gen.physical[1], gen.world_size,
                    f", hosting ranks {gen.hosted}" if gen.hosted else "")
        return replace(restored, event=Restored(out.resume_step))
    # Re-protect the resume version under the new membership, in the background, moving only
    # the images a holder lacks (the replacement's own, and those the lost rank held): until it
    # commits, a further failure is planned from the replicas the previous generation left.
    # The image just restored from is that version already: mirrored as is, not captured again.
    failed = protect(rt, out.resume_step, MISSING, restored=out.image)
    # The own images were restored from, now mirrored or dropped: their buffers may go to the new engine.
    restored = replace(restored, own_images=[], standby_buffers=[])
    engine = rt.engine()
    if engine is not None:
        reuse.donate_retired([], engine)
        if rt.standby_buffers:  # a pre-built spare: the rest of its pool was faulted in while it waited
            engine.donate(rt.standby_buffers)
    if failed is not None:
        return replace(restored, event=failed)
    via = (f"{out.source}: {out.bytes_received - out.bytes_from_replicas} bytes from holders, "
           f"{out.bytes_from_replicas} from live replicas" if out.bytes_from_replicas else out.source)
    log.warning("rank %d: resumed at step %d in generation %d (%s)", rt.rank, out.resume_step, g, via)
    return replace(restored, event=Restored(out.resume_step))


def engine_pool_in_memory(rt: WorkerRuntime) -> bool:
    """The own images are this process's anonymous memory (not node-local shm files another process
    could write): as trusted as the live state, restored without re-reading their checksums."""
    return not (rt.ctx.shm_dir and rt.mirror_config.node_local)


def _restore_locally(registry: StateRegistry, image: StateImage, verify: bool = True) -> None:
    """Load an image with every group answering locally: state that replays a collective (a DDP
    reducer's bucket rebuild) computes the same answer on every rank from the same captured facts."""
    with groups.local_only():
        restore(registry, image, verify=verify)
    # Gradients are not in the image: a survivor's partial sums of an accumulation window it rolled
    # back from must not be added to the window's replay (state/window.py). (A DDP or FSDP2 model's
    # restore clears its own already.)
    clear_grads(obj for _, obj in registry.items())


# A rank that has not reported this long after leaving a generation is stuck somewhere it should
# not be (the leader gives a live rank the collective timeout + 10 s): its threads' stacks go to its
# log once, so the hang can be read afterwards instead of guessed (the report cancels the dump).
STUCK_DUMP_S = 30.0


def leave(rt: WorkerRuntime, a: LeaveGroups) -> Changed:
    """Leave the failed generation: unbind its groups (their communicators are torn down off this thread:
    ``worker/reaper.py``), keep the own images, reset per-iteration state; then the machine reports."""
    started = time.monotonic()
    rt.ledger.emit(EventKind.FAILURE_DETECTED, generation=a.generation, reason=a.reason[:200])
    log.warning("rank %d: leaving generation %d: %s", rt.rank, a.generation, a.reason)
    faulthandler.dump_traceback_later(STUCK_DUMP_S, exit=False)
    rt.heartbeat.recovering()
    left = Changed()
    if rt.micro is not None:  # the hosted ranks go with this generation (a further incident plans them lost)
        rt.micro.close()
        left = Changed(micro=None)
    gen = rt.gen
    if gen is not None:
        if gen.engine is not None:
            left = replace(left, committed=gen.engine.committed_version)
        own = gen.leave()
        if own:  # kept for the restore (and listed in the report)
            left = replace(left, own_images=own)
    else:
        groups.release_all(a.generation)
    try:  # a restore writes the live tensors: the last capture's copies out of them must be done
        rt.write_order.drain(rt.mirror_config.timeout_s)
    except DeviceTimeout as exc:  # only that image is lost (never committed); the restore goes on
        log.warning("rank %d: %s", rt.rank, exc)
    # A collective that failed mid forward/backward leaves FSDP2 per-iteration state (pending
    # all-gathers, unsharded parameters, partial gradients) that the retried step would trip on.
    reset = rt.registry.reset_after_failure()
    if reset:
        log.info("rank %d: reset FSDP2 state of %s after the failure", rt.rank, reset)
    now = time.monotonic()
    rt.ledger.emit(EventKind.GENERATION_LEFT, generation=a.generation, seconds=round(now - started, 4))
    return replace(left, event=Left(now))


def report(rt: WorkerRuntime, a: Report) -> Event:
    assert rt.control is not None and rt.seen is not None
    rep = build_report(rt.worker_id, rt.own_images, rt.peer_store, rt.committed, recheck=rt.notes.recheck)
    if not groups.user_groups() and hosted.why_not_shrinkable(rt.registry, hosted.ddp_modules(rt.registry)) is None:
        rep = replace(rep, can_host=True)  # its state can run a lost rank's micro-batches (--lost-node shrink)
    try:
        rt.control.report(a.generation, rt.rank, rep, a.reason, rt.notes.bad_snapshot, rt.notes.bad_copies,
                          groups.timed_out(a.generation))
    except CoordinatorUnavailable as exc:
        return CoordinatorLost(str(exc))
    faulthandler.cancel_dump_traceback_later()
    return Reported(time.monotonic())
