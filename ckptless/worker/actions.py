"""Executors of the worker machine's actions: the I/O of a worker's life.

Why a module of its own: :mod:`ckptless.worker.machine` decides, this module
does (etcd, groups, transfers, the training loop), and turns each outcome
into exactly one event. Every executor catches what its layer raises and
types it: a failure of the transport is a ``Fault`` (recover), an error in
the user's step is a ``UserError`` (fail fast), a deterministic local problem
is ``Internal``. Failures are turned into events *outside* ``except`` blocks:
a live traceback pins the broken communicator's sockets and keeps peers
blocked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator
from typing import TYPE_CHECKING

from ckptless import chaos_hooks
from ckptless.errors import (
    CoordinatorUnavailable,
    IntegrityError,
    MirrorError,
    RecoveryError,
    SnapshotError,
    StateError,
    TransportError,
    UnrecoverableError,
)
from ckptless.goodput.ledger import EventKind
from ckptless.mirror.partial import MISSING, PairSpec
from ckptless.recovery.executor import (RestoreInputs, SnapshotLoadFailed, apply_decision, build_report,
                                        restore_early)
from ckptless.recovery.plan import DiskFallback, RecoveryPlan
from ckptless.recovery.transfer import Received, execute_transfers
from ckptless.recovery.wire import Membership
from ckptless.state.capture import StateImage, restore
from ckptless.state.registry import StateRegistry
from ckptless.worker import exit_guard, groups, reuse
from ckptless.worker.control import JobEndedError
from ckptless.worker.faults import is_fault
from ckptless.worker.generation import Generation
from ckptless.worker.machine import (
    Action,
    AwaitMembership,
    Committed,
    CoordinatorLost,
    Event,
    Exit,
    Fault,
    FormFailed,
    Formed,
    FormGroups,
    Internal,
    JobEnded,
    LeaveGroups,
    Left,
    MarkReady,
    MembershipSeen,
    Report,
    Reported,
    Reprotected,
    RestoreFailed,
    RestoreState,
    Restored,
    Stepped,
    TimedOut,
    Train,
    UserError,
    WaitFinalCommit,
)

if TYPE_CHECKING:
    from ckptless.job import Job, RunResult

log = logging.getLogger(__name__)


def execute(job: Job, action: Action) -> Event | None:
    if isinstance(action, AwaitMembership):
        return _await(job, action)
    if isinstance(action, FormGroups):
        return _form(job, action)
    if isinstance(action, RestoreState):
        return _restore(job, action)
    if isinstance(action, MarkReady):
        return _mark_ready(job, action)
    if isinstance(action, Train):
        return train(job, action.generation, action.from_step, action.until_reprotected)
    if isinstance(action, WaitFinalCommit):
        return _final_commit(job)
    if isinstance(action, LeaveGroups):
        return _leave(job, action)
    if isinstance(action, Report):
        return _report(job, action)
    if isinstance(action, Exit):
        return None  # the machine is terminal; Job._drive leaves the way the state says
    raise TypeError(f"unknown action {action!r}")


# --- membership -----------------------------------------------------------------------------------
def _await(job: Job, a: AwaitMembership) -> Event:
    assert job.control is not None
    try:
        m = job.control.wait_membership(a.after, a.deadline)
    except JobEndedError as exc:
        return JobEnded(exc.status.reason)
    except CoordinatorUnavailable as exc:
        return CoordinatorLost(str(exc))
    now = time.monotonic()
    if m is None:
        return TimedOut(now)
    includes = m.rank_of(job.worker_id) is not None
    if includes:
        job.adopt(m)
    return MembershipSeen(m.generation, includes, m.decision is not None, now)


def _abort_reason(job: Job, generation: int) -> str | None:
    c = job.control
    if c is None:
        return None
    if c.ended is not None:
        return "the job ended"
    if c.incident(generation):
        return f"generation {generation} was declared failed"
    if c.superseded(generation):
        return "a newer generation was published"
    return None


def _form(job: Job, a: FormGroups) -> Event:
    m = job.seen
    assert m is not None and m.generation == a.generation
    gen = Generation(m, job.worker_id, job.store_for(m))
    job.gen = gen
    _roll_back_early(job, gen)
    reason = ""
    try:
        _transfer_ahead(job, m, a.deadline)
        gen.mirror_group = groups.bind_all(gen.store, m.generation, gen.rank, gen.world_size,  # type: ignore[arg-type]
                                           job.ctx.collective_timeout_s, a.deadline,
                                           lambda: _abort_reason(job, m.generation))
    except TransportError as exc:
        reason = str(exc)
    except (IntegrityError, RecoveryError) as exc:  # from the transfers run ahead
        reason = f"{type(exc).__name__}: {exc}"
    if reason:
        job.forget_store()  # a broken client never recovers (a partition, a store restart): connect anew
        return FormFailed(reason)
    gen.bound = True
    if m.decision is not None:
        job.ledger.emit(EventKind.GROUPS_REFORMED, generation=m.generation)
    return Formed(m.generation, -1)


def _mark_ready(job: Job, a: MarkReady) -> Event | None:
    if job.control is None:
        return None
    try:
        job.control.mark_ready(a.generation, job.rank)
    except CoordinatorUnavailable as exc:
        return CoordinatorLost(str(exc))
    return None


# --- recovery ----------------------------------------------------------------------------------------
# --- transfers ahead of the formation ------------------------------------------------------------
def _transfers_ahead(m: Membership) -> bool:
    """Does generation ``m`` run its plan's transfers on its mirror group before the other groups
    form? Every rank decides the same from the same plan."""
    d = m.decision
    return isinstance(d, RecoveryPlan) and bool(d.transfers) and not d.node_local


def start_transfer_ahead(job: Job) -> None:
    """A respawned replacement: receive its image while the script runs its setup.

    Called by ``init()`` once the membership that names it is known and before
    the script builds its objects. Why: the survivors wait for the setup
    anyway (the user's groups cannot form before it); the image's bytes need
    no user object, only the generation's mirror group, so they move meanwhile.
    The thread's outcome is taken by :func:`_transfer_ahead` in ``run()``.
    """
    m = job.seen
    if m is None or not _transfers_ahead(m) or job.replicas == 0:
        return
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["received"] = _transfer_now(job, m, time.monotonic() + job.ctx.recovery_timeout_s)
        except BaseException as exc:  # handed to the main thread in run()
            box["error"] = exc

    t = threading.Thread(target=work, name=f"ckptless-transfer-g{m.generation}", daemon=True)
    exit_guard.watch(t.is_alive, t.join)
    job.transfer_ahead = (m.generation, t, box)
    t.start()


def _transfer_now(job: Job, m: Membership, deadline: float) -> Received | None:
    rank = m.rank_of(job.worker_id)
    assert rank is not None and isinstance(m.decision, RecoveryPlan)
    pg = groups.form_mirror_group(job.store_for(m), m.generation, rank, m.world_size, job.ctx.collective_timeout_s,
                                  deadline, lambda: _abort_reason(job, m.generation))
    try:
        return execute_transfers(m.decision, m, job.worker_id, job.peer_store, job.ctx.collective_timeout_s,
                                 into=job.standby_buffers[0] if job.standby_buffers else None, group=pg)
    except RuntimeError as exc:  # a raw Gloo call on the mirror group: a peer failed
        raise TransportError(f"transfers of generation {m.generation} failed: {exc}") from exc


def _transfer_ahead(job: Job, m: Membership, deadline: float) -> None:
    """Run (or, for a replacement, collect) the plan's transfers before the user's groups form."""
    job.received_ahead = None
    if not _transfers_ahead(m) or job.replicas == 0:
        return
    ahead, job.transfer_ahead = job.transfer_ahead, None
    if ahead is not None and ahead[0] == m.generation:
        _, t, box = ahead
        groups.wait_thread(t, m.generation, deadline, lambda: _abort_reason(job, m.generation),
                           "transfers did not finish")
        if "error" in box:
            raise box["error"]
        received = box.get("received")
    else:
        received = _transfer_now(job, m, deadline)
    job.received_ahead = (m.generation, received)


def _restore_inputs(job: Job, gen: Generation) -> RestoreInputs:
    early = job.restored_early
    ahead = job.received_ahead
    return RestoreInputs(gen.membership, job.worker_id, job.registry, job.own_images, job.peer_store,
                         job.ctx.collective_timeout_s, job.ctx.job_id, job.ctx.snapshot_dir,
                         restore_fn=_restore_locally,
                         shm_dir=job.ctx.shm_dir if job.mirror_config.node_local else None,
                         node_id=job.ctx.node_id, into=job.standby_buffers[0] if job.standby_buffers else None,
                         own_images_trusted=engine_pool_in_memory(job),
                         restored_early=early[1] if early is not None and early[0] == gen.number else None,
                         transfers_done=ahead is not None and ahead[0] == gen.number,
                         received_early=ahead[1] if ahead is not None and ahead[0] == gen.number else None)


def _roll_back_early(job: Job, gen: Generation) -> None:
    """A survivor that resumes from its own image rolls back while the generation forms (it waits
    for every rank there anyway; a respawn runs its setup first). Best effort: on any error the
    restore after the formation does it, and reports it, the usual way."""
    job.restored_early = None
    if gen.decision is None or not job.own_images:
        return
    try:
        image = restore_early(gen.decision, _restore_inputs(job, gen))
    except Exception as exc:  # noqa: BLE001 - the restore after the formation raises it, typed, if it recurs
        log.info("rank %d: early rollback skipped (%s); restoring after the formation", job.rank, exc)
        return
    if image is not None:
        job.restored_early = (gen.number, image)


def _restore(job: Job, a: RestoreState) -> Event:
    gen = job.gen
    assert gen is not None and gen.decision is not None
    inputs = _restore_inputs(job, gen)
    job.restored_early = job.received_ahead = None
    reason, internal = "", ""
    try:
        if isinstance(gen.decision, DiskFallback):
            with groups.local_only():  # a disk load moves no bytes between ranks
                out = apply_decision(gen.decision, inputs)
        else:
            out = apply_decision(gen.decision, inputs)
    except SnapshotLoadFailed as exc:
        job.bad_snapshot = exc.step
        reason = str(exc)
    except (TransportError, IntegrityError, SnapshotError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    except (StateError, UnrecoverableError, RecoveryError) as exc:
        internal = f"cannot restore generation {a.generation}'s state: {type(exc).__name__}: {exc}"
    if internal:
        return Internal(internal)
    job.restore_failed = bool(reason)
    if reason:
        return RestoreFailed(reason)
    g = a.generation
    if out.source == "disk":
        lost = out.steps_lost
        if g == 0 and job.ledger.last_step_before is not None:  # a whole-job restart: the previous run's work
            lost = max(0, job.ledger.last_step_before - out.resume_step)
            log.warning("rank %d: resumed from the disk snapshot of step %d; %d steps of the previous run lost",
                        job.rank, out.resume_step, lost)
        job.ledger.emit(EventKind.DISK_RESTORE, step=out.resume_step, generation=g, steps_lost=lost)
    else:
        job.ledger.emit(EventKind.TRANSFER_DONE, generation=g, bytes=out.bytes_received)
        job.ledger.emit(EventKind.ROLLBACK_DONE, step=out.resume_step, generation=g, source=out.source)
    job.recoveries += 1
    job.bad_snapshot = None
    job.resume_version = out.resume_step
    job.first_after_recovery = True
    # Re-protect the resume version under the new membership, in the background, moving only
    # the images a holder lacks (the replacement's own, and those the lost rank held): until it
    # commits, a further failure is planned from the replicas the previous generation left.
    # The image just restored from is that version already: mirrored as is, not captured again.
    failed = _protect(job, out.resume_step, MISSING, restored=out.image)
    job.own_images = []  # restored from, now mirrored or dropped: their buffers may go to the new engine
    engine = job.engine()
    if engine is not None:
        reuse.donate_retired(job, engine)
        if job.standby_buffers:  # a pre-built spare: the rest of its pool was faulted in while it waited
            engine.donate(job.standby_buffers)
    job.standby_buffers = []
    if failed is not None:
        return failed
    log.warning("rank %d: resumed at step %d in generation %d (%s)", job.rank, out.resume_step, g, out.source)
    return Restored(out.resume_step)


def engine_pool_in_memory(job: Job) -> bool:
    """The own images are this process's anonymous memory (not node-local shm files another process
    could write): as trusted as the live state, restored without re-reading their checksums."""
    return not (job.ctx.shm_dir and job.mirror_config.node_local)


def _restore_locally(registry: StateRegistry, image: StateImage, verify: bool = True) -> None:
    """Load an image with every group answering locally: state that replays a collective (a DDP
    reducer's bucket rebuild) computes the same answer on every rank from the same captured facts."""
    with groups.local_only():
        restore(registry, image, verify=verify)


def _leave(job: Job, a: LeaveGroups) -> Event:
    job.ledger.emit(EventKind.FAILURE_DETECTED, generation=a.generation, reason=a.reason[:200])
    log.warning("rank %d: leaving generation %d: %s", job.rank, a.generation, a.reason)
    job.heartbeat.recovering()
    gen = job.gen
    if gen is not None:
        if gen.engine is not None:
            job.committed = gen.engine.committed_version
        own = gen.leave()
        if own:
            job.own_images = own
    else:
        groups.release_all(a.generation)
    # A collective that failed mid forward/backward leaves FSDP2 per-iteration state (pending
    # all-gathers, unsharded parameters, partial gradients) that the retried step would trip on.
    reset = job.registry.reset_after_failure()
    if reset:
        log.info("rank %d: reset FSDP2 state of %s after the failure", job.rank, reset)
    return Left(time.monotonic())


def _report(job: Job, a: Report) -> Event:
    assert job.control is not None and job.seen is not None
    rep = build_report(job.worker_id, job.own_images, job.peer_store, job.committed, recheck=job.restore_failed)
    try:
        job.control.report(a.generation, job.rank, rep, a.reason, job.bad_snapshot)
    except CoordinatorUnavailable as exc:
        return CoordinatorLost(str(exc))
    return Reported(time.monotonic())


# --- training ------------------------------------------------------------------------------------------
def _protect(job: Job, version: int, pairs: PairSpec = None, restored: StateImage | None = None) -> Event | None:
    """Capture ``version`` (or mirror the image just ``restored``) and hand it to the mirror engine;
    a broken engine is a fault."""
    reason = ""
    try:
        if not reuse.mirror_restored(job, version, restored, pairs):
            job.capture_and_mirror(version, pairs)
    except (MirrorError, TransportError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    except StateError as exc:  # the script's state cannot be captured: the user's to fix
        job.exit_error = exc
        return UserError(f"{type(exc).__name__}: {exc}")
    return Fault(reason) if reason else None


def _call_step(job: Job, step: int) -> Event | None:
    """Run the user's step for ``step`` (the callback API); classify what escapes it."""
    assert job.spec is not None and job.spec.train_step is not None
    try:
        job.spec.train_step(step)
        return None
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:
        outcome = classify(job, exc)
    return outcome  # outside the except block: the traceback no longer pins the communicator


def classify(job: Job, exc: BaseException) -> Event:
    """What an exception escaping the user's step means: a Fault (recover) or a UserError (fail fast)."""
    if isinstance(exc, SystemExit):
        if exc.code in (None, 0):
            raise exc
        job.exit_error = exc
        return UserError(f"SystemExit: {exc.code}")
    c = job.control
    if job.recovery and is_fault(exc, job.generation, c.incident if c is not None else None):
        return Fault(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    job.exit_error = exc
    return UserError(f"{type(exc).__name__}: {exc}")


def train(job: Job, generation: int, from_step: int, until_reprotected: bool) -> Event:
    """Run steps until the end, a failure, or (after a recovery) the re-protection committed."""
    it = train_steps(job, generation, from_step, until_reprotected)
    try:
        step = next(it)
        while True:
            step = it.send(_call_step(job, step))
    except StopIteration as stop:
        return stop.value


def train_steps(job: Job, generation: int, from_step: int, until_reprotected: bool) -> Generator[int, Event | None, Event]:
    """The training loop as a generator: yields each step to run, receives how it ended (None: done).

    Why a generator: the callback API (``run``) and the loop API (``for step in job.steps(n)``) are
    the same loop; only who runs the user's code differs. Returns the machine's next event.
    """
    spec = job.spec
    assert spec is not None
    every = job.mirror_config.mirror_every
    step = spec.start_step if from_step < 0 else from_step
    if from_step < 0 and job.replicas > 0:
        failed = _protect(job, step)  # the initial state: a failure before step 1 restarts from it
        if failed is not None:
            return failed
    c = job.control
    while step < spec.steps:
        if c is not None:
            if c.ended is not None and c.ended.state == "failed":
                return JobEnded(c.ended.reason)
            if c.incident(generation):
                return Fault(f"the coordinator declared generation {generation} failed")
        chaos_hooks.pause_point(f"step:r{job.rank}:{step}", rank=job.rank, step=step)
        failed = yield step
        if failed is not None:
            return failed
        job.registry_step_done()
        done = step + 1
        job.heartbeat.beat(done, generation=generation, committed=job.committed_version,
                           replica_bytes=job.peer_store.bytes_held if job.peer_store is not None else 0)
        if job.replicas > 0 and (done % every == 0 or done == spec.steps):
            failed = _protect(job, done)
            if failed is not None:
                return failed
        if job.snapshots is not None and job.snapshots.maybe_snapshot(done, generation):
            job.ledger.emit(EventKind.SNAPSHOT_SAVED, step=done, generation=generation,
                            block_s=job.snapshots.last_block_s)
        kind = EventKind.FIRST_STEP_AFTER_RECOVERY if job.first_after_recovery else EventKind.STEP_DONE
        job.ledger.emit(kind, step=done, generation=generation)
        job.first_after_recovery = False
        step = done
        if until_reprotected and _reprotected(job):
            return Reprotected(step)
    return Stepped(step, done=True)


def _reprotected(job: Job) -> bool:
    target = job.resume_version
    committed = job.committed_version
    if target is None or committed is None or committed < target:
        return False
    job.ledger.emit(EventKind.REPROTECT_DONE, generation=job.generation, version=committed)
    return True


def _final_commit(job: Job) -> Event:
    engine = job.gen.engine if job.gen is not None else None
    assert job.spec is not None
    if engine is None:
        return Committed()
    reason = ""
    try:
        if not engine.wait_committed(job.spec.steps, timeout=job.mirror_config.timeout_s):
            reason = f"the final version {job.spec.steps} was not committed within {job.mirror_config.timeout_s}s"
    except MirrorError as exc:
        reason = f"{type(exc).__name__}: {exc}"
    return Fault(reason) if reason else Committed()


def _resume_from_snapshot(job: Job) -> int:
    """No coordinator: a whole-job restart still resumes from the newest verified snapshot (every rank
    applies the same choice rule to the same directory, so they agree)."""
    d = job.ctx.snapshot_dir
    if not d:
        return 0
    from ckptless.snapshot import choose_snapshot, load_snapshot

    info, _ = choose_snapshot(d, job.ctx.job_id, job.world_size)
    if info is None:
        return 0
    step = load_snapshot(info, job.registry, job.rank)
    lost = max(0, (job.ledger.last_step_before or step) - step)
    job.ledger.emit(EventKind.DISK_RESTORE, step=step, generation=0, steps_lost=lost)
    log.warning("rank %d: resumed from the disk snapshot of step %d (%d steps of the previous run lost)",
                job.rank, step, lost)
    return step


def plain_steps(job: Job) -> Generator[int, None, None]:
    """No coordinator or nothing to mirror to: the steps to run; any failure propagates (ends the job)."""
    spec = job.spec
    assert spec is not None
    job.first_after_recovery = False
    start = max(spec.start_step, _resume_from_snapshot(job))
    for s in range(start, spec.steps):
        yield s
        job.registry_step_done()
        job.heartbeat.beat(s + 1)
        if job.snapshots is not None and job.snapshots.maybe_snapshot(s + 1, job.generation):
            job.ledger.emit(EventKind.SNAPSHOT_SAVED, step=s + 1, generation=job.generation,
                            block_s=job.snapshots.last_block_s)
        job.ledger.emit(EventKind.STEP_DONE, step=s + 1, generation=job.generation)


def run_without_recovery(job: Job) -> RunResult:
    """No coordinator or nothing to mirror to: train; any failure propagates (and ends the job)."""
    from ckptless.job import RunResult

    spec = job.spec
    assert spec is not None and spec.train_step is not None
    for s in plain_steps(job):
        spec.train_step(s)
    return RunResult(spec.steps - spec.start_step, spec.steps, None, job.generation, 0)
