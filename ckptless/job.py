"""The user-facing job: ``init()``, ``protect()``, ``run()``.

Why a loop API (``run(train_step, steps)``) instead of hooks: the framework
must own the points between steps to capture, mirror, commit and, after a
failure, roll back and resume. User code then holds no recovery logic: after a
recovery ``torch.distributed``'s default group is valid again and
``train_step`` is simply called with the next step number.

Version ``v`` is the protected state after ``v`` completed steps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ckptless.errors import CkptlessError, ConfigError, MirrorError, TransportError
from ckptless.goodput.ledger import EventKind
from ckptless.mirror.config import MirrorConfig
from ckptless.mirror.mirror import MirrorEngine
from ckptless.mirror.store import PeerStore, StoredImage
from ckptless.recovery.executor import RECOVERABLE, PeerFailure, apply_decision, build_report, is_recoverable
from ckptless.recovery.wire import Membership
from ckptless.snapshot import SnapshotConfig, SnapshotWriter
from ckptless.state.capture import Capturer, StateImage
from ckptless.state.registry import StateRegistry
from ckptless.worker import exit_guard
from ckptless.worker.context import WorkerContext
from ckptless.worker.control import WorkerControl
from ckptless.worker.groups import Groups, connect_store, destroy_groups, form_groups
from ckptless.worker.heartbeat import Heartbeat
from ckptless.worker.ledger import WorkerLedger

log = logging.getLogger(__name__)

# Engines of failed generations. Never freed: their unregistered mirror groups may
# still have Gloo operations in flight on native threads, and freeing a group or
# a buffer under such an operation aborts the process. Each holds a few sockets
# and threads; the image pools are released (see Job._leave).
_RETIRED_ENGINES: list[MirrorEngine] = []


@dataclass(frozen=True)
class RunResult:
    steps: int
    final_version: int
    committed_version: int | None
    generation: int
    recoveries: int


class Job:
    """One rank's handle on the protected training job (see :func:`init`)."""

    def __init__(self, ctx: WorkerContext, mirror_config: MirrorConfig | None = None) -> None:
        self.ctx = ctx
        self.registry = StateRegistry()
        self.recoveries = 0
        # One process cannot mirror to a peer: K is capped at world size - 1.
        self.replicas = min(ctx.replicas, ctx.world_size - 1)
        self._mirror_config = mirror_config or MirrorConfig.build(
            replicas=max(self.replicas, 1), mirror_every=ctx.mirror_every, placement=ctx.placement,
            shm_dir=ctx.shm_dir, timeout_s=ctx.collective_timeout_s,
        )
        self.heartbeat = Heartbeat(os.environ.get("CKPTLESS_HEARTBEAT_FILE"))
        self.control: WorkerControl | None = None
        self.membership: Membership | None = None
        self.worker_id = ctx.worker_id
        if ctx.etcd_endpoint and self.replicas > 0:
            self.control = WorkerControl(ctx.etcd_endpoint, ctx.job_id, ctx.worker_id)
            after = -1 if ctx.role == "spare" else ctx.generation - 1
            self.membership = self.control.wait_membership(ctx.recovery_timeout_s if ctx.role != "spare" else 7 * 86400,
                                                           after=after)
        self.rank = ctx.rank if self.membership is None else self.membership.rank_of(self.worker_id) or 0
        self.world_size = ctx.world_size if self.membership is None else self.membership.world_size
        self.generation = ctx.generation if self.membership is None else self.membership.generation
        if ctx.role == "spare":
            os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size)})
        if self.replicas > 0:
            self._mirror_config.validate_for_world(self.world_size)
        self.ledger = WorkerLedger(ctx.goodput_dir, self.rank)
        self.ledger.emit(EventKind.JOB_START, generation=self.generation, role=ctx.role)
        self._store: dist.Store | None = None
        self._store_addr: tuple[str, int] | None = None
        self.groups: Groups | None = None
        while self.groups is None:
            try:
                self.groups = self._form()
            except RECOVERABLE as exc:
                if ctx.role == "member" or self.control is None or not is_recoverable(exc):
                    raise
                # A peer failed while we were joining: say we hold nothing, take the next generation.
                log.warning("worker %s: generation %d failed while joining: %s", self.worker_id, self.generation, exc)
                destroy_groups()
                self.control.report(self.generation, self.rank, build_report(self.worker_id, [], None, None))
                self.membership = self.control.wait_membership(ctx.recovery_timeout_s, after=self.generation)
                self.generation = self.membership.generation
                self.rank = self.membership.rank_of(self.worker_id) or 0
        self.engine: MirrorEngine | None = None
        self.peer_store: PeerStore | None = None
        self._own_images: list[StoredImage] = []
        self._capturer: Capturer | None = None
        self.snapshots: SnapshotWriter | None = None
        # A replacement or spare joins a recovery in progress: it rebuilds in run().
        self._rejoin = self.membership.decision if (self.membership is not None and ctx.role != "member") else None

    # --- groups --------------------------------------------------------------------
    def _form(self) -> Groups:
        if self.membership is not None:
            addr = (self.membership.store_host, self.membership.store_port)
        else:
            addr = (self.ctx.master_addr, self.ctx.master_port)
        if self._store is None or self._store_addr != addr:
            self._store = connect_store(addr[0], addr[1], self.ctx.collective_timeout_s)
            self._store_addr = addr
        control = self.control
        abort = (lambda: control.incident(self.generation)) if control is not None else None
        return form_groups(self._store, self.generation, self.rank, self.world_size,
                           self.ctx.collective_timeout_s, abort,
                           arrive_timeout_s=max(self.ctx.recovery_timeout_s, self.ctx.collective_timeout_s))

    def _node_of(self) -> list[str] | None:
        if self.membership is None:
            return None
        return [self.membership.worker_of(r).node_id for r in range(self.world_size)]

    # --- protection --------------------------------------------------------------
    def protect(self, **objs: Any) -> None:
        """Register Stateful objects (model, optimizer, scheduler, data position, extras).

        RNG streams are protected automatically under the name ``rng``.
        """
        self.registry.protect(**objs)
        self._capturer = None  # the layout changed
        if self.ctx.snapshot_dir and self.ctx.snapshot_every and self.snapshots is None:
            self.snapshots = SnapshotWriter(
                SnapshotConfig(Path(self.ctx.snapshot_dir), self.ctx.job_id, every=self.ctx.snapshot_every),
                self.registry, self.rank, self.world_size)

    @property
    def capturer(self) -> Capturer:
        if self._capturer is None:
            self._capturer = Capturer(self.registry, self.ctx.job_id, self.rank, self._mirror_config.chunk_bytes)
        return self._capturer

    def _ensure_engine(self) -> MirrorEngine | None:
        if self.replicas == 0:
            return None
        if self.engine is None:
            assert self.groups is not None
            self.engine = MirrorEngine(
                self.groups.mirror, self.ctx.job_id, self._mirror_config, generation=self.generation,
                node_of=self._node_of(), store=self.peer_store,
            )
            self.peer_store = self.engine.store
        return self.engine

    @property
    def committed_version(self) -> int | None:
        return None if self.engine is None else self.engine.committed_version

    def capture_and_mirror(self, version: int) -> StateImage:
        """Capture the protected state as ``version`` and hand it to the mirror engine."""
        engine = self._ensure_engine()
        if engine is None:
            return self.capturer.capture(version, self.generation)
        buf = engine.acquire_buffer(self.capturer.required_bytes())
        image = self.capturer.capture(version, self.generation, out=buf)
        engine.submit(image.manifest, image.buffer)
        return image

    # --- the loop ------------------------------------------------------------------
    def run(self, train_step: Callable[[int], Any], steps: int, start_step: int = 0) -> RunResult:
        """Call ``train_step(step)`` for ``step`` in ``[start_step, steps)``, protected and recovered."""
        if steps < start_step:
            raise ConfigError("steps", steps, f"must be >= start_step ({start_step})")
        if len(self.registry) <= 1:
            log.warning("ckptless: nothing protected besides RNG; call job.protect(model=..., optimizer=...)")
        every = self._mirror_config.mirror_every
        step = start_step
        first_after_recovery = False
        if self._rejoin is not None:
            step = self._recover(None)
            first_after_recovery = True
        elif self.replicas > 0:
            step = self._guarded(lambda: self.capture_and_mirror(start_step), start_step)
        while True:
            while step < steps:
                failure: str | None = None
                done = step + 1
                try:
                    if self.control is not None and self.control.incident(self.generation):
                        raise PeerFailure(f"generation {self.generation} was declared failed")
                    train_step(step)
                    self.heartbeat.beat(done)
                    if self.replicas > 0 and (done % every == 0 or done == steps):
                        self.capture_and_mirror(done)
                    if self.snapshots is not None and self.snapshots.maybe_snapshot(done, self.generation):
                        self.ledger.emit(EventKind.SNAPSHOT_SAVED, step=done, generation=self.generation,
                                         block_s=self.snapshots.last_block_s)
                except RECOVERABLE as exc:
                    if not is_recoverable(exc) or self.control is None:
                        raise
                    failure = f"{type(exc).__name__}: {exc}"
                if failure is not None:  # outside the except block: the traceback no longer pins the group
                    step = self._recover(failure)
                    first_after_recovery = True
                    continue
                kind = EventKind.FIRST_STEP_AFTER_RECOVERY if first_after_recovery else EventKind.STEP_DONE
                self.ledger.emit(kind, step=done, generation=self.generation)
                first_after_recovery = False
                step = done
            # The final version must be committed too; a failure here sends us back.
            resumed = self._guarded(lambda: self._finish(steps), steps)
            if resumed == steps:
                break
            step, first_after_recovery = resumed, True
        committed = self.committed_version
        return RunResult(steps - start_step, steps, committed, self.generation, self.recoveries)

    def _guarded(self, fn: Callable[[], Any], step: int) -> int:
        """Run ``fn``; on a peer failure recover and return the resume step instead."""
        failure: str | None = None
        try:
            fn()
        except RECOVERABLE as exc:
            if not is_recoverable(exc) or self.control is None:
                raise
            failure = f"{type(exc).__name__}: {exc}"
        return step if failure is None else self._recover(failure)

    # --- recovery ------------------------------------------------------------------
    def _leave(self) -> None:
        """Drop the broken groups at once; keep our images and the peer store."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.retire()
            _RETIRED_ENGINES.append(engine)
            exit_guard.watch(engine.thread_alive, engine.join)
            self._own_images = engine.own_images() or self._own_images
            self.peer_store = engine.store
        destroy_groups()
        if engine is not None:
            engine.join(0.2)  # usually done at once: its peers are gone

    def _recover(self, failure: str | None) -> int:
        """Leave, report, await the next generation, rebuild, roll back; returns the resume step."""
        assert self.control is not None
        t0 = time.monotonic()
        if failure is not None:
            log.warning("rank %d: failure in generation %d: %s", self.rank, self.generation, failure)
            self.ledger.emit(EventKind.FAILURE_DETECTED, generation=self.generation, reason=failure[:200])
        deadline = t0 + self.ctx.recovery_timeout_s
        self.heartbeat.recovering()
        pending = self._rejoin if failure is None else None
        while True:
            failure = None
            try:
                if pending is None:
                    self._leave()
                    self.control.report(self.generation, self.rank, build_report(
                        self.worker_id, self._own_images, self.peer_store, self.committed_version))
                    left = deadline - time.monotonic()
                    self.membership = self.control.wait_membership(max(left, 0.1), after=self.generation)
                    self.generation = self.membership.generation
                    self.groups = self._form()
                    self.ledger.emit(EventKind.GROUPS_REFORMED, generation=self.generation)
                pending = None
                self._rejoin = None
                assert self.membership is not None and self.membership.decision is not None
                resume = apply_decision(self, self.membership, self.membership.decision)
                # Restore K replicas under the new membership. The round runs in the
                # background while training resumes: until it commits, a second
                # failure is planned from the replicas the old generation left.
                self.capture_and_mirror(resume)
            except RECOVERABLE as exc:
                if not is_recoverable(exc):
                    raise
                failure = f"{type(exc).__name__}: {exc}"
                pending = None
            if failure is None:
                self.recoveries += 1
                self._own_images = []
                log.warning("rank %d: resumed at step %d in generation %d after %.3fs",
                            self.rank, resume, self.generation, time.monotonic() - t0)
                return resume
            log.warning("rank %d: failure during recovery: %s", self.rank, failure)
            self.ledger.emit(EventKind.FAILURE_DETECTED, generation=self.generation, reason=failure[:200])

    def _finish(self, final_version: int) -> int | None:
        engine = self.engine
        if engine is None:
            return None
        if not engine.wait_committed(final_version, timeout=self._mirror_config.timeout_s):
            raise TransportError(f"final version {final_version} was not committed within {self._mirror_config.timeout_s}s")
        return engine.committed_version

    def close(self) -> None:
        """Stop mirroring and snapshots and leave the groups (idempotent)."""
        if self.snapshots is not None:
            try:
                self.snapshots.close(timeout=self.ctx.recovery_timeout_s)
            except CkptlessError as exc:  # a last-resort copy failed: report it, the run itself succeeded
                log.warning("rank %d: disk snapshot failed: %s", self.rank, exc)
            self.snapshots = None
        if self.engine is not None:
            try:
                self.engine.close(timeout=self._mirror_config.timeout_s)
            except MirrorError:
                log.warning("mirror engine did not stop cleanly", exc_info=True)
            self.engine = None
        self.ledger.emit(EventKind.JOB_END, generation=self.generation)
        self.ledger.close()
        if dist.is_initialized():
            try:
                dist.barrier()  # nobody tears the groups down under a peer still finishing
            except RuntimeError:
                log.info("final barrier failed; leaving anyway", exc_info=True)
        destroy_groups()
        if self.control is not None:
            self.control.close()
        self.heartbeat.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _enable_crash_stacks() -> None:
    """A worker that dies on a fatal signal prints every thread's Python stack: cheap, and the
    only trace a native abort (SIGABRT/SIGSEGV) leaves."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


def init(env: dict[str, str] | None = None) -> Job:
    """Join the job from inside a ``ckptless-run`` (or torchrun) worker.

    Forms the training group (the default ``torch.distributed`` group) and the
    mirroring group from the agent-hosted store. A spare blocks here until the
    coordinator assigns it a rank.
    """
    t0 = time.monotonic()
    _enable_crash_stacks()
    job = Job(WorkerContext.from_env(env))
    log.info("rank %d joined generation %d in %.3fs", job.rank, job.generation, time.monotonic() - t0)
    return job

