"""The driver of a worker's machine: feeds events, executes actions, leaves the way the state says.

Why a module of its own: the machine (:mod:`ckptless.worker.machine`) is pure;
something must hold its current state, run the actions it returns through
the executors (:mod:`ckptless.worker.actions`) and feed back what happened.
That is this class, and it owns everything that loop touches (the
:class:`~ckptless.worker.runtime.WorkerRuntime`). The user's
:class:`~ckptless.job.Job` is a thin API over it: it decides *when* to drive
(``init()`` up to the point where the script's objects are needed, ``run()``
or ``steps()`` to the end), never *how*.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist

from ckptless import environment
from ckptless.errors import CkptlessError, ConfigError, MirrorError, RecoveryError
from ckptless.goodput import EventKind
from ckptless.mirror import MirrorConfig
from ckptless.recovery import Assignment
from ckptless.recovery import Membership
from ckptless.state import host_memory
from ckptless.state import write_digest
from ckptless.worker import (abort, actions, ahead, deferral, exit_file, exit_guard, groups, hosted, nccl_env,
                             rank_reads, setup_notice, training)
from ckptless.worker.context import WorkerContext
from ckptless.worker.faults import device_failure, is_fault
from ckptless.worker.generation import Generation
from ckptless.worker.machine import (
    Action,
    AwaitMembership,
    Event,
    Failed,
    FormGroups,
    Forming,
    Joining,
    RestoreState,
    Started,
    State,
    Train,
    UserError,
    WaitFinalCommit,
    WorkerConfig,
    step,
)
from ckptless.worker.runtime import Changed, RunSpec, WorkerRuntime

log = logging.getLogger(__name__)

SPARE_WAIT_S = 7 * 86400.0  # a warm spare waits for a rank as long as the job lives


class WorkerDriver:
    """Holds the machine's state and the runtime; runs actions until told to pause or the end."""

    def __init__(self, ctx: WorkerContext, mirror_config: MirrorConfig | None, heartbeat_file: str | None) -> None:
        exit_guard.install()
        self.rt = WorkerRuntime(ctx, mirror_config, heartbeat_file)
        if self.rt.recovery:
            # torch's NCCL machinery must not end a survivor or a replacement: before any communicator exists
            nccl_env.apply(ctx.recovery_timeout_s)
            abort.install()  # a collective that fails ends its generation's communicators at once
        # A survivor awaits the next generation while the leader may wait for a replacement node
        # (--replacement-timeout) and then plans it: it must not give up first.
        self.cfg = WorkerConfig(join_timeout_s=ctx.recovery_timeout_s, form_timeout_s=max(600.0, ctx.recovery_timeout_s),
                                await_timeout_s=max(600.0, ctx.recovery_timeout_s + ctx.replacement_timeout_s))
        self.state: State = Joining(0.0)
        self._pending: deque[Action] = deque()
        self._closed = False
        rt = self.rt
        # The worker's effective configuration, once per incarnation: what it was told, as it parsed it.
        config = json.dumps({**ctx.describe(), **environment.current().describe()}, sort_keys=True, default=str)
        rt.ledger.emit(EventKind.JOB_START, generation=ctx.generation, role=ctx.role, config=config)
        exit_guard.on_uncaught(self._record_uncaught)
        if rt.prebuilt:
            # A warm spare builds the script's objects as its standby rank before it has a rank:
            # its groups stay unbound (collectives answer locally) until it is assigned one.
            assert ctx.standby_rank is not None
            groups.ensure_default_group(groups.connect_store(ctx.master_addr, ctx.master_port,
                                                             ctx.collective_timeout_s),
                                        ctx.standby_rank, ctx.world_size, ctx.collective_timeout_s)
        if rt.recovery:
            self.feed(Started(time.monotonic(), SPARE_WAIT_S if ctx.role == "spare" else None))
            self.drive(self._needs_user_objects)
            if not rt.prebuilt and self._pending and isinstance(self._pending[0], FormGroups):
                rt.transfer_ahead = ahead.start_during_setup(rt)  # a replacement: its image moves during the setup
        else:
            self._start_without_coordinator()

    # --- the machine --------------------------------------------------------------------------
    def feed(self, event: Event) -> None:
        if isinstance(event, UserError) and event.error is not None:
            self.rt.user_exception = event.error  # re-raised from run() (see _raise_failure)
        self.state, acts = step(self.state, event, self.cfg)
        self._pending.extend(acts)

    def _apply(self, changed: Changed) -> None:
        """What an executor did: its changes written (here only: the driver owns the runtime), then its event."""
        if changed.adopt is not None:
            self._adopt(changed.adopt)
        self.rt.apply(changed)
        if changed.event is not None:
            self.feed(changed.event)

    def _adopt(self, m: Membership) -> None:
        """A membership that includes this worker: it becomes the one the worker's identity derives from."""
        first = self.rt.seen is None
        other_rank = actions.admit(self.rt, m)  # (a spare that cannot take its rank re-executes: never returns)
        self.rt.seen = m
        actions.adopted(self.rt, m, first, other_rank)

    def _needs_user_objects(self, action: Action) -> bool:
        """Where ``init()`` stops: before anything that needs the script's objects or its run()."""
        if isinstance(action, (RestoreState, Train, WaitFinalCommit)):
            return True
        if self.rt.prebuilt and isinstance(action, AwaitMembership) and self.rt.seen is None:
            return True  # a pre-built spare waits for its rank in run(), with its objects built
        # A generation made by a recovery forms only once every rank's script built its
        # objects (a replacement runs its setup on unbound groups, see worker/rebindable.py).
        return isinstance(action, FormGroups) and isinstance(self.state, Forming) and self.state.restore

    def drive(self, pause: Callable[[Action], bool] | None = None) -> None:
        """Execute pending actions until ``pause`` says stop or the machine has none left."""
        while self._pending:
            action = self._pending[0]
            if pause is not None and pause(action):
                return
            self._pending.popleft()
            self._apply(actions.execute(self.rt, action))
        if isinstance(self.state, Failed):
            self._raise_failure(self.state)

    def drive_steps(self) -> Generator[int, Event | None, None]:
        """The drive loop for the loop API: yields each step to the caller's ``for`` body."""
        while self._pending:
            action = self._pending.popleft()
            if isinstance(action, Train):
                changed = Changed.of((yield from training.train_steps(self.rt, action.generation, action.from_step,
                                                                      action.until_reprotected)))
            else:
                changed = actions.execute(self.rt, action)
            self._apply(changed)
        if isinstance(self.state, Failed):
            self._raise_failure(self.state)

    def _record_uncaught(self, exc: BaseException) -> None:
        """An exception escaped the script outside run()/guard() (its setup, say): record it as the
        user's error, so the launcher's summary shows its traceback and nobody respawns into it;
        one caused by a failed peer or collective stays a fault: recorded as one, since an exit code
        without a record reads as the user's error (recovery/view.py: ``exit_outcome``)."""
        if exit_file.written() or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        device = device_failure(exc)  # the GPU failed (in the setup, or in a capture's copy)
        if device is not None:
            exit_file.write("device", device.error)
            return
        if self.rt.recovery and is_fault(exc, self.rt.generation, self.rt.incident_check()):
            exit_file.write("fault", exit_file.summarize(exc))
            return
        exit_file.write("user_error", exit_file.summarize(exc))

    def _raise_failure(self, st: Failed) -> None:
        """Leave the way the failure calls for; the agent reads how from the exit file."""
        rank = self.rt.rank
        if st.kind == "user_error":
            exc = self.rt.user_exception
            exit_file.write("user_error", None if exc is None else exit_file.summarize(exc))
            code = getattr(exc, "code", 1) if isinstance(exc, SystemExit) else 1
            exit_guard.set_exit_code(code if isinstance(code, int) else 1)
            if exc is not None:
                raise exc
            raise RecoveryError(st.message)
        if st.kind == "device":
            # The GPU failed: nothing more is asked of this process's CUDA context (see leave_now).
            exit_file.write("device", st.error)
            detail = st.error.traceback if st.error is not None else ""
            corrupt = st.error is not None and st.error.type == "SilentDataCorruption"
            how = ("rebuilt from its replicas (its device or memory is suspect: a spare, or a respawn on another "
                   "GPU where it has one)" if corrupt else "recovered without this GPU (a spare, or a respawn on "
                   "another GPU)")
            print(f"{detail}[ckptless] rank {rank}: {st.message}; this process exits, and its rank is {how}",
                  file=sys.stderr, flush=True)
            exit_guard.leave_now(1)
        if st.kind in ("job_ended", "fenced"):
            exit_file.write(st.kind)
            print(f"[ckptless] rank {rank}: {st.message}", file=sys.stderr, flush=True)
            exit_guard.set_exit_code(1)
            raise SystemExit(1)
        err = RecoveryError(f"rank {rank}: {st.message}")
        exit_file.write("internal", exit_file.summarize(err))
        raise err

    def _start_without_coordinator(self) -> None:
        """No etcd or nothing to mirror to (K = 0, world size 1): one generation, failures end the job."""
        rt, c = self.rt, self.rt.ctx
        m = Membership(c.generation, c.world_size, c.master_addr, c.master_port,
                       tuple(Assignment(r, rt.worker_id if r == c.rank else f"rank{r}", c.node_id, "survivor")
                             for r in range(c.world_size)))
        self._adopt(m)
        gen = Generation(m, rt.worker_id, rt.store_for(m))
        gen.mirror_group = groups.bind_all(gen.store, c.generation, gen.rank, gen.world_size, c.collective_timeout_s,  # type: ignore[arg-type]
                                           time.monotonic() + c.recovery_timeout_s)
        gen.bound = True
        rt.gen = gen

    # --- the run ------------------------------------------------------------------------------------
    def prepare(self, train_step: Callable[[int], Any] | None, steps: int, start_step: int) -> None:
        """Checks and set-up between the script's setup and its first step."""
        rt = self.rt
        if steps < start_step:
            raise ConfigError("steps", steps, f"must be >= start_step ({start_step})")
        if rt.spec is not None:
            raise ConfigError("run", steps, "a job trains once: run() or steps() was already called")
        if len(rt.registry) <= 1:
            log.warning("ckptless: nothing protected besides RNG; call job.protect(model=..., optimizer=...)")
        else:
            from ckptless.data import protects_data_position

            if not protects_data_position(rt.registry) and rt.rank == 0:
                log.warning("ckptless: no protected object holds a data position: after a recovery the resumed "
                            "ranks will not replay the same batches unless the batches come from protected state "
                            "(the RNG, a step counter); protect one, e.g. data=ckptless.data.resumable(loader)")
        rt.spec = RunSpec(train_step, steps, start_step)
        if rt.ctx.lost_node == "shrink" and rt.rank == 0 and rt.ctx.role == "member" and rt.ctx.generation == 0:
            why = (f"it made process groups {groups.user_groups()}" if groups.user_groups()
                   else hosted.why_not_shrinkable(rt.registry, hosted.ddp_modules(rt.registry)))
            if why is not None:  # said at start, not first at the loss it would have served
                log.warning("ckptless: --lost-node shrink cannot apply to this job (%s): a node lost with no spare "
                            "waits for a replacement instead (--replacement-timeout)", why)
        reads = rank_reads.stop()  # a pre-built spare's setup ends here
        if setup_notice.says(rt.prebuilt, rt.ctx.standby_rank):  # once per job, at start: what a spare costs
            warn, text = setup_notice.notice(reads, rank_reads.setup_times(), rank_reads.watched_from_start(),
                                             rt.ctx.world_size, rank_reads.imported_before_init())
            log.log(logging.WARNING if warn else logging.INFO, "%s", text)
        if rt.ctx.role == "member" and rt.ctx.generation == 0:
            self.write_digest("init")  # only when a chaos runner asked: the state training starts from
        # The script's setup objects (torch's modules, the model) live for the whole job: frozen out
        # of the cyclic GC, the full collection a recovery runs to close the failed generation's
        # sockets (groups.release_all) scans only what was made since, e.g. 0.13-0.3 s -> ~1 ms.
        gc.collect()
        gc.freeze()
        if rt.prebuilt and rt.seen is None and rt.replicas > 0:
            # While it waits for a rank, a warm spare faults in the buffers of its future capture pool
            # (the first one receives its image, which is then mirrored from it): the first-touch page
            # faults of S bytes each are taken off the recovery's critical path and its first steps.
            plan = rt.capturer.plan()
            n = max(1, rt.mirror_config.pool_buffers)
            if (n == 2 and plan.can_defer(rt.capturer.mirror_replicated)
                    and deferral.covered(plan, rt.write_order.optimizers)):
                n = 1  # its captures will leave the replicated prefix live: the second buffer holds a suffix
            rt.standby_buffers = [host_memory.empty(plan.total).zero_() for _ in range(n)]

    def end_at(self, steps: int) -> None:
        """The loop API's function returned: the run ends at version ``steps`` (``job.train`` learns it then)."""
        assert self.rt.spec is not None
        self.rt.spec = dataclasses.replace(self.rt.spec, steps=steps)

    def write_digest(self, name: str = "digest") -> None:
        """The protected state's digest, only when a chaos runner asked (``CKPTLESS_DIGEST_DIR``)."""
        if self.rt.spec is not None:
            write_digest(self.rt.registry, self.rt.rank, self.rt.spec.steps, name=name)

    def close(self) -> None:
        """Stop mirroring and snapshots and leave the groups (idempotent)."""
        rt = self.rt
        if not self._closed:
            self.write_digest()
        self._closed = True
        if rt.snapshots is not None:
            try:
                rt.snapshots.close(timeout=rt.ctx.recovery_timeout_s)
            except CkptlessError as exc:  # a last-resort copy failed: report it, the run itself succeeded
                log.warning("rank %d: disk snapshot failed: %s", rt.rank, exc)
            rt.snapshots = None
        gen = rt.gen
        if gen is not None and gen.engine is not None:
            try:
                gen.engine.close(timeout=rt.mirror_config.timeout_s)
            except MirrorError:
                log.warning("mirror engine did not stop cleanly", exc_info=True)
            gen.engine = None
        rt.ledger.emit(EventKind.JOB_END, generation=rt.generation)
        rt.ledger.close()
        # Nobody tears the groups down under a peer still finishing; unless the script already did, after
        # training (Accelerate's end_training() destroys the process group): a finished job never fails here.
        if gen is not None and gen.bound and dist.is_initialized():
            try:
                dist.barrier()
            except (RuntimeError, ValueError, CkptlessError):
                log.info("final barrier failed; leaving anyway", exc_info=True)
        if rt.peer_store is not None:
            rt.peer_store.close(unlink=True)
        if rt.control is not None:
            rt.control.close()
            rt.control = None
        rt.heartbeat.close()
