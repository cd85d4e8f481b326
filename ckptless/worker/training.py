"""Executors of the training side: the step loop, protection of each version, the final commit.

Why a module of its own: this is the only code that runs the user's step,
so it is where an exception is classified (a ``Fault`` is recovered, a
``UserError`` fails the job fast) and where each completed version is
captured and handed to the mirror engine. The callback API (``run``) and the
loop API (``for step in job.steps(n)``) share one loop, :func:`train_steps`.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

from ckptless import chaos_hooks
from ckptless.errors import MirrorError, SilentDataCorruption, StateError, TransportError
from ckptless.goodput import EventKind
from ckptless.mirror import PairSpec
from ckptless.state import StateImage
from ckptless.worker import exit_file, groups, handoff, plain_resume, reuse
from ckptless.worker.faults import device_failure, is_fault
from ckptless.worker.machine import (
    Committed,
    DeviceFailed,
    Event,
    Fault,
    JobEnded,
    Reprotected,
    Stepped,
    UserError,
)
from ckptless.worker.runtime import KEEP, Changed, RunResult, WorkerRuntime

log = logging.getLogger(__name__)


class NoMoreSteps:
    """Sent for the step yielded last when the caller's loop ended before running it (``job.train``:
    the function returned with no batch of that step fetched): the run ends at that version."""


NO_MORE_STEPS = NoMoreSteps()


def protect(rt: WorkerRuntime, version: int, pairs: PairSpec = None, restored: StateImage | None = None) -> Event | None:
    """Capture ``version`` (or mirror the image just ``restored``) and hand it to the mirror engine;
    a broken engine is a fault."""
    reason = ""
    try:
        if not reuse.mirror_restored(rt.engine(), restored, version, rt.rank, rt.ctx.job_id, rt.generation, pairs):
            rt.capture_and_mirror(version, pairs)
    except (MirrorError, TransportError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    except SilentDataCorruption as exc:  # replicas differ (mirror/replica_check.py): the job's policy
        return sdc_event(rt, exc)
    except StateError as exc:  # the script's state cannot be captured: the user's to fix
        return UserError(f"{type(exc).__name__}: {exc}", exc)
    return Fault(reason) if reason else None


def _call_step(rt: WorkerRuntime, step: int) -> Event | None:
    """Run the user's step for ``step`` (the callback API); classify what escapes it."""
    assert rt.spec is not None and rt.spec.train_step is not None
    try:
        rt.spec.train_step(step)
        return None
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:
        outcome = classify(rt, exc)
    return outcome  # outside the except block: the traceback no longer pins the communicator


def classify(rt: WorkerRuntime, exc: BaseException) -> Event:
    """What an exception escaping the user's step means: a Fault (recover) or a UserError (fail fast)."""
    if isinstance(exc, SystemExit):
        if exc.code in (None, 0):
            raise exc
        return UserError(f"SystemExit: {exc.code}", exc)
    failed = device_failure(exc)  # the GPU itself failed: neither the user's error nor recoverable here
    if failed is not None:
        return failed
    if rt.recovery and is_fault(exc, rt.generation, rt.incident_check()):
        return Fault(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    return UserError(f"{type(exc).__name__}: {exc}", exc)


def train(rt: WorkerRuntime, generation: int, from_step: int, until_reprotected: bool) -> Event | Changed:
    """Run steps until the end, a failure, or (after a recovery) the re-protection committed."""
    it = train_steps(rt, generation, from_step, until_reprotected)
    try:
        step = next(it)
        while True:
            step = it.send(_call_step(rt, step))
    except StopIteration as stop:
        return stop.value


def train_steps(rt: WorkerRuntime, generation: int, from_step: int,
                until_reprotected: bool) -> Generator[int, Event | NoMoreSteps | None, Event | Changed]:
    """The training loop as a generator: yields each step to run, receives how it ended (None: done).

    Why a generator: the callback API (``run``) and the loop API (``for step in job.steps(n)``) are
    the same loop; only who runs the user's code differs. Returns the machine's next event (with what
    it changed in the runtime, when growing back: the driver applies it).
    ``rt.spec.steps`` is read at every step: ``job.train`` learns it only when the loop ends.
    ``until_reprotected``: this is the first training after a restore, from the resume version
    ``from_step``; it returns once that version is committed again under the new membership.
    """
    spec = rt.spec
    assert spec is not None
    every = rt.mirror_config.mirror_every
    step = spec.start_step if from_step < 0 else from_step
    if from_step < 0 and rt.replicas > 0:
        failed = protect(rt, step)  # the initial state: a failure before step 1 restarts from it
        if failed is not None:
            return failed
    first_after_recovery = until_reprotected
    if from_step < 0 or until_reprotected:  # at the initial or the resume version (mirrored at restore)
        rt.start_windows_at(step)  # nothing stepped since (a restore cleared the gradients)
    c = rt.control
    while step < _total(rt):
        if c is not None:
            if c.ended is not None and c.ended.state == "failed":
                return JobEnded(c.ended.reason)
            if c.incident(generation):
                return Fault(f"the coordinator declared generation {generation} failed")
        # Fewer ranks: grow back here, all together? (Only at a window's start: the handover is an image.)
        if rt.gen is not None and rt.gen.physical is not None and rt.window.clean:
            grown = _grow_back(rt, generation, step)
            if grown is not None:
                return grown
        chaos_hooks.pause_point(f"step:r{rt.rank}:{step}", rank=rt.rank, step=step)
        chaos_hooks.announce_rank(rt.rank)  # (chaos runs only: the process a timed kill of this rank hits)
        rt.write_order.before_step()  # the step must not overwrite what the last capture still copies
        failed = yield from _one_step(rt, step)
        if isinstance(failed, NoMoreSteps):
            return _ended_before(rt, step)
        if failed is None and groups.collective_failed(generation, settle_s=0.0):
            # The step returned, but a collective of it failed: with NCCL an aborted all-reduce's
            # future completes anyway (at enqueue), so the step may have applied garbage. Never
            # protect or count it; the rollback restores the committed version.
            failed = Fault(f"a collective of generation {generation} failed during step {step}")
        if failed is not None:
            return failed
        done = step + 1
        rt.step_done(done, generation)
        clean = rt.window.boundary()  # False: inside an accumulation window, replayed from its start
        mirrored = rt.gen is None or rt.gen.physical is None  # a generation with fewer ranks is not mirrored
        if mirrored and rt.replicas > 0:
            if rt.mirror_now(done % every == 0, clean, final=done == _total(rt)):
                failed = protect(rt, done)
                if failed is not None:
                    return failed
                rt.protected_at(done)
        if mirrored:  # (with fewer ranks, the hosted ranks' parts of a snapshot would never be written)
            rt.maybe_snapshot(done, generation, clean)
        kind = EventKind.FIRST_STEP_AFTER_RECOVERY if first_after_recovery else EventKind.STEP_DONE
        rt.ledger.emit(kind, step=done, generation=generation)
        first_after_recovery = False
        step = done
        if until_reprotected and _reprotected(rt, from_step):
            return Reprotected(step)
    return Stepped(step, done=True)


def _total(rt: WorkerRuntime) -> int:
    assert rt.spec is not None
    return rt.spec.steps


def _ended_before(rt: WorkerRuntime, step: int) -> Event:
    """The loop ended before running ``step``: the run's last version is ``step`` (protected unless it
    already is: the newest version protected, initial and resume versions included)."""
    mirrored = rt.gen is None or rt.gen.physical is None
    if mirrored and rt.replicas > 0 and step != rt.last_protected:
        failed = protect(rt, step)
        if failed is not None:
            return failed
    return Stepped(step, done=True)


def _grow_back(rt: WorkerRuntime, generation: int, step: int) -> Changed | None:
    """A generation with fewer ranks asked to grow back: every process leaves at this boundary, its
    state (and its hosted ranks') handed over as images of version ``step`` (worker/handoff.py)."""
    own = None
    try:
        if not handoff.agreed(rt, generation):
            return None
        own = handoff.capture_own(rt, step)
        handoff.hand_over(rt, step, own)
        event = Fault(f"growing back to full width at step {step}: spares take the hosted ranks")
    except Exception as exc:  # noqa: BLE001 - a peer lost meanwhile: the usual fault path
        event = Fault(f"{type(exc).__name__} while growing back at step {step}: {str(exc)[:200]}")
    return Changed(event, own_images=[*rt.own_images, own] if own is not None else KEEP)


def _one_step(rt: WorkerRuntime, step: int) -> Generator[int, Any, Any]:
    """Run step ``step``: once, or (fewer ranks) once per hosted rank's micro-batch, then as this rank."""
    micro = rt.micro
    if micro is None:
        return (yield step)
    for r in [*micro.order(), None]:
        try:
            micro.enter(r)  # (restores this rank's own state itself if it fails)
        except Exception as exc:  # noqa: BLE001 - a hosted rank's state that no longer loads: re-planned
            return Fault(f"cannot run hosted rank {r}'s micro-batch of step {step}: {type(exc).__name__}: {exc}")
        try:
            failed = yield step
        finally:
            micro.leave(r)
        if failed is not None:
            return failed
    return None


def _reprotected(rt: WorkerRuntime, resume_version: int) -> bool:
    committed = rt.committed_version
    if committed is None or committed < resume_version:
        return False
    rt.ledger.emit(EventKind.REPROTECT_DONE, generation=rt.generation, version=committed)
    return True


def sdc_event(rt: WorkerRuntime, exc: SilentDataCorruption) -> Event:
    """Replicas differ: this rank leaves as a failed device (the policy replaces a rank the evidence
    proves corrupt: its agent marks its GPU bad, if it has one, and the rank is rebuilt from its
    replicas), or the job stops with the error (a stop, not the script's bug: the leader says so)."""
    if exc.replace:
        return DeviceFailed(exit_file.summarize(exc))
    return UserError(f"{type(exc).__name__}: {exc}", exc)


def final_commit(rt: WorkerRuntime) -> Event:
    engine = rt.gen.engine if rt.gen is not None else None
    assert rt.spec is not None
    if engine is None:
        return Committed()
    reason = ""
    try:
        if not engine.wait_committed(rt.spec.steps, timeout=rt.mirror_config.timeout_s):
            reason = (f"the final version {rt.spec.steps} was not committed (its mirror round ended without it, "
                      f"or ran past {rt.mirror_config.timeout_s}s)")
    except SilentDataCorruption as exc:
        return sdc_event(rt, exc)
    except MirrorError as exc:
        reason = f"{type(exc).__name__}: {exc}"
    return Fault(reason) if reason else Committed()


def _resume_from_snapshot(rt: WorkerRuntime) -> int:
    """No coordinator: a whole-job restart still resumes from the newest snapshot whose files verify on
    every rank, the same step on every rank (``plain_resume``: each rank reads its own files and the
    ranks vote through the generation's store, O(S) bytes per rank). The plain start always binds a
    generation with a store; the branch without one is defensive (every rank reads every rank's files)."""
    d = rt.ctx.snapshot_dir
    if not d:
        return 0
    from ckptless.snapshot import choose_snapshot, load_snapshot

    store = rt.gen.store if rt.gen is not None else None
    if store is not None:
        info = plain_resume.choose_agreed(d, rt.ctx.job_id, rt.rank, rt.world_size, store, rt.generation,
                                          rt.ctx.recovery_timeout_s)
    else:
        info, _ = choose_snapshot(d, rt.ctx.job_id, rt.world_size)
    if info is None:
        return 0
    step = load_snapshot(info, rt.registry, rt.rank)
    lost = max(0, (rt.ledger.last_step_before or step) - step)
    rt.ledger.emit(EventKind.DISK_RESTORE, step=step, generation=rt.generation, steps_lost=lost)
    log.warning("rank %d: resumed from the disk snapshot of step %d (%d steps of the previous run lost)",
                rt.rank, step, lost)
    return step


def plain_steps(rt: WorkerRuntime) -> Generator[int, None, None]:
    """No coordinator or nothing to mirror to: the steps to run; any failure propagates (ends the job)."""
    spec = rt.spec
    assert spec is not None
    resumed = _resume_from_snapshot(rt)
    s = max(spec.start_step, resumed)
    # A restarted job (torchrun's restart: a later generation, or a relaunch that found a snapshot): its
    # first step closes the incident in the ledger, as a recovery's does.
    first = resumed > 0 or rt.generation > 0
    while s < _total(rt):  # (read every step: job.train learns it when its loop ends)
        chaos_hooks.announce_rank(rt.rank)  # (chaos runs only)
        yield s
        rt.step_done(s + 1, rt.generation, mirrored=False)
        rt.maybe_snapshot(s + 1, rt.generation, rt.window.boundary())
        rt.ledger.emit(EventKind.FIRST_STEP_AFTER_RECOVERY if first else EventKind.STEP_DONE, step=s + 1,
                       generation=rt.generation)
        first = False
        s += 1


def run_without_recovery(rt: WorkerRuntime) -> RunResult:
    """No coordinator or nothing to mirror to: train; any failure propagates (and ends the job)."""
    spec = rt.spec
    assert spec is not None and spec.train_step is not None
    for s in plain_steps(rt):
        spec.train_step(s)
    return RunResult(spec.steps - spec.start_step, spec.steps, None, rt.generation, 0)
