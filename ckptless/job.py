"""The user-facing job: ``init()``, ``protect()``, ``run()``, ``close()``.

Why a loop API (``run(train_step, steps)``): the framework must own the points
between steps to capture, mirror, commit and, after a failure, roll back and
resume. User code then holds no recovery logic: after a recovery its groups
(default, subgroups, DDP, FSDP2) work again and ``train_step`` is simply
called with the next step number.

How it is driven: a worker's life is the pure state machine of
:mod:`ckptless.worker.machine`; this class executes the actions it returns
(:mod:`ckptless.worker.actions` holds the executors) and feeds back what
happened. ``init()`` runs the machine until it needs the user's objects (a
replacement restores them only in ``run()``, after the script built them);
``run()`` runs it to the end.

Version ``v`` is the protected state after ``v`` completed steps.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptless.errors import CkptlessError, ConfigError, MirrorError, RecoveryError
from ckptless.goodput.ledger import EventKind
from ckptless.mirror.config import MirrorConfig
from ckptless.mirror.mirror import MirrorEngine
from ckptless.mirror.partial import PairSpec
from ckptless.mirror.store import PeerStore, StoredImage
from ckptless.recovery.wire import Membership
from ckptless.snapshot import SnapshotConfig, SnapshotWriter
from ckptless.state.capture import Capturer, StateImage
from ckptless.state.registry import StateRegistry
from ckptless.worker import actions, adoption, exit_file, exit_guard, groups, rank_reads, reuse, setup_seed
from ckptless.worker.context import WorkerContext
from ckptless.worker.control import WorkerControl
from ckptless.worker.faults import is_fault
from ckptless.worker.generation import Generation
from ckptless.worker.heartbeat import Heartbeat
from ckptless.worker.ledger import WorkerLedger
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
    is_terminal,
    step,
)

log = logging.getLogger(__name__)

SPARE_WAIT_S = 7 * 86400.0  # a warm spare waits for a rank as long as the job lives
EXIT_REEXEC = 75  # a pre-built spare assigned another rank: its agent starts it again as that rank


@dataclass(frozen=True)
class RunResult:
    steps: int
    final_version: int
    committed_version: int | None
    generation: int
    recoveries: int


@dataclass(frozen=True)
class RunSpec:
    train_step: Callable[[int], Any] | None  # None: the loop API (job.steps), the caller runs each step
    steps: int
    start_step: int


_UNSET: Any = object()


class Job:
    """One rank's handle on the protected training job (see :func:`init`)."""

    def __init__(self, ctx: WorkerContext, mirror_config: MirrorConfig | None = None) -> None:
        self.ctx = ctx
        self.worker_id = ctx.worker_id
        self.registry = StateRegistry()
        self.recoveries = 0
        exit_guard.install()
        # One process cannot mirror to a peer: K is capped at world size - 1.
        self.replicas = min(ctx.replicas, ctx.world_size - 1)
        self.recovery = bool(ctx.etcd_endpoint) and self.replicas > 0
        self.mirror_config = mirror_config or MirrorConfig.build(
            replicas=max(self.replicas, 1), mirror_every=ctx.mirror_every, placement=ctx.placement,
            shm_dir=ctx.shm_dir, timeout_s=ctx.collective_timeout_s, pool_buffers=ctx.mirror_buffers,
        )
        self.heartbeat = Heartbeat(os.environ.get("CKPTLESS_HEARTBEAT_FILE"))
        self.ledger = WorkerLedger(ctx.goodput_dir, None if ctx.role == "spare" else ctx.rank)
        self.control: WorkerControl | None = None
        if self.recovery:
            assert ctx.etcd_endpoint is not None
            self.control = WorkerControl(ctx.etcd_endpoint, ctx.job_id, ctx.worker_id)
            self.control.mark_ported()
        self.gen: Generation | None = None
        self.seen: Membership | None = None  # the newest membership that includes us
        self.peer_store: PeerStore | None = None
        self.own_images: list[StoredImage] = []
        self.committed: int | None = None
        self.snapshots: SnapshotWriter | None = None
        self.spec: RunSpec | None = None
        self.exit_error: BaseException | None = None  # the user's exception, re-raised from run()
        self.bad_snapshot: int | None = None
        self.restore_failed = False  # the last restore failed: the next report re-reads every replica
        self.restored_early: tuple[int, StateImage] | None = None  # (generation, own image rolled back to)
        self.transfer_ahead: Any = None  # a replacement's (generation, thread, outcome) of its transfers
        self.received_ahead: Any = None  # (generation, what the transfers run ahead received)
        self.resume_version: int | None = None
        self.first_after_recovery = False
        # A pre-built spare's receive buffer and further pool buffers, faulted in while it waits.
        self.standby_buffers: list[torch.Tensor] = []
        self._capturer: Capturer | None = None
        self._store: tuple[tuple[str, int], dist.Store] | None = None
        self._cfg = WorkerConfig(join_timeout_s=ctx.recovery_timeout_s, form_timeout_s=max(600.0, ctx.recovery_timeout_s),
                                 await_timeout_s=max(600.0, ctx.recovery_timeout_s))
        self._state: State = Joining(0.0)
        self._pending: deque[Action] = deque()
        self._closed = False
        self._guard_outcome: Any = _UNSET
        self.ledger.emit(EventKind.JOB_START, generation=ctx.generation, role=ctx.role)
        exit_guard.on_uncaught(self._record_uncaught)
        self.prebuilt = self.recovery and ctx.standby_rank is not None
        if self.prebuilt:
            # A warm spare builds the script's objects as its standby rank before it has a rank:
            # its groups stay unbound (collectives answer locally) until it is assigned one.
            assert ctx.standby_rank is not None
            groups.ensure_default_group(groups.connect_store(ctx.master_addr, ctx.master_port,
                                                             ctx.collective_timeout_s),
                                        ctx.standby_rank, ctx.world_size, ctx.collective_timeout_s)
        if self.recovery:
            self.feed(Started(time.monotonic(), SPARE_WAIT_S if ctx.role == "spare" else None))
            self._drive(self._needs_user_objects)
            if not self.prebuilt and self._pending and isinstance(self._pending[0], FormGroups):
                actions.start_transfer_ahead(self)  # a replacement: its image moves during the setup
        else:
            self._start_without_coordinator()

    # --- identity (derived from the generation, never copied) ---------------------------------
    @property
    def rank(self) -> int:
        rank_reads.note("job.rank")
        if self.seen is not None:
            r = self.seen.rank_of(self.worker_id)
            if r is not None:
                return r
        if self.ctx.standby_rank is not None:
            return self.ctx.standby_rank
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.seen.world_size if self.seen is not None else self.ctx.world_size

    @property
    def generation(self) -> int:
        return self.seen.generation if self.seen is not None else self.ctx.generation

    @property
    def committed_version(self) -> int | None:
        engine = self.gen.engine if self.gen is not None else None
        return engine.committed_version if engine is not None else self.committed

    @property
    def state(self) -> State:
        return self._state

    # --- the machine --------------------------------------------------------------------------
    def feed(self, event: Event) -> None:
        self._state, acts = step(self._state, event, self._cfg)
        self._pending.extend(acts)

    def _needs_user_objects(self, action: Action) -> bool:
        """Where ``init()`` stops: before anything that needs the script's objects or its run()."""
        if isinstance(action, (RestoreState, Train, WaitFinalCommit)):
            return True
        if self.prebuilt and isinstance(action, AwaitMembership) and self.seen is None:
            return True  # a pre-built spare waits for its rank in run(), with its objects built
        # A generation made by a recovery forms only once every rank's script built its
        # objects (a replacement runs its setup on unbound groups, see worker/rebindable.py).
        return isinstance(action, FormGroups) and isinstance(self._state, Forming) and self._state.restore

    def _drive(self, pause: Callable[[Action], bool] | None = None) -> None:
        while self._pending:
            action = self._pending[0]
            if pause is not None and pause(action):
                return
            self._pending.popleft()
            event = actions.execute(self, action)
            if event is not None:
                self.feed(event)
        if isinstance(self._state, Failed):
            self._raise_failure(self._state)

    def _drive_steps(self) -> Generator[int, Event | None, None]:
        """The drive loop for the loop API: yields each step to the caller's ``for`` body."""
        while self._pending:
            action = self._pending.popleft()
            if isinstance(action, Train):
                event: Event | None = yield from actions.train_steps(self, action.generation, action.from_step,
                                                                     action.until_reprotected)
            else:
                event = actions.execute(self, action)
            if event is not None:
                self.feed(event)
        if isinstance(self._state, Failed):
            self._raise_failure(self._state)

    def _record_uncaught(self, exc: BaseException) -> None:
        """An exception escaped the script outside run()/guard() (its setup, say): record it as the
        user's error, so the launcher's summary shows its traceback and nobody respawns into it;
        one caused by a failed peer or collective stays a fault (no record: the rank is recovered)."""
        if exit_file.written() or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        c = self.control
        if self.recovery and is_fault(exc, self.generation, c.incident if c is not None else None):
            return
        exit_file.write("user_error", exit_file.summarize(exc))

    def _raise_failure(self, st: Failed) -> None:
        """Leave the way the failure calls for; the agent reads how from the exit file."""
        if st.kind == "user_error":
            exc = self.exit_error
            exit_file.write("user_error", None if exc is None else exit_file.summarize(exc))
            code = getattr(exc, "code", 1) if isinstance(exc, SystemExit) else 1
            exit_guard.set_exit_code(code if isinstance(code, int) else 1)
            if exc is not None:
                raise exc
            raise RecoveryError(st.message)
        if st.kind in ("job_ended", "fenced"):
            exit_file.write(st.kind)
            print(f"[ckptless] rank {self.rank}: {st.message}", file=sys.stderr, flush=True)
            exit_guard.set_exit_code(1)
            raise SystemExit(1)
        err = RecoveryError(f"rank {self.rank}: {st.message}")
        exit_file.write("internal", exit_file.summarize(err))
        raise err

    # --- groups and stores ----------------------------------------------------------------------
    def store_for(self, m: Membership) -> dist.Store:
        addr = (m.store_host, m.store_port)
        if self._store is None or self._store[0] != addr:
            self._store = (addr, groups.connect_store(addr[0], addr[1], self.ctx.collective_timeout_s))
        return self._store[1]

    def forget_store(self) -> None:
        """Drop the cached store client: the next generation connects a fresh one."""
        self._store = None

    def adopt(self, m: Membership) -> None:
        """A membership that includes us: take its rank (a spare learns it now) and make the default group."""
        first = self.seen is None
        assigned = m.rank_of(self.worker_id)
        other_rank = self.prebuilt and first and assigned != self.ctx.standby_rank
        if other_rank:
            why = "it is not in the plan" if assigned is None else adoption.why_not(self, m, assigned)
            if why is not None:
                log.warning("spare %s cannot take rank %s as built: %s", self.worker_id, assigned, why)
                self._reexec(assigned)
        self.seen = m
        if other_rank:
            assert assigned is not None
            log.warning("spare %s built as rank %s takes rank %d as built (same layout): no re-exec, no setup",
                        self.worker_id, self.ctx.standby_rank, assigned)
            adoption.take_rank(self, assigned, m.world_size)
        rank = self.rank
        if first and self.ctx.role == "spare":
            os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(m.world_size)})
        self.ledger.set_rank(rank)
        if first and self.ctx.role == "spare":  # its start had no rank to be written under: the report's
            self.ledger.emit(EventKind.JOB_START, generation=m.generation, role="spare")  # "replacement ready"
        groups.ensure_default_group(self.store_for(m), rank, m.world_size, self.ctx.collective_timeout_s)

    def _reexec(self, rank: int | None) -> None:
        """A pre-built spare assigned a rank other than its standby one: its objects and groups were
        built for the wrong rank, so it ends now and its agent starts it again (warm) as that rank."""
        log.warning("spare %s was built as rank %s but assigned rank %s: restarting as rank %s",
                    self.worker_id, self.ctx.standby_rank, rank, rank)
        exit_file.write("reexec")
        self.heartbeat.close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_REEXEC)  # nothing else runs here: groups unbound, no engine, no snapshot yet

    def _start_without_coordinator(self) -> None:
        """No etcd or nothing to mirror to (K = 0, world size 1): one generation, failures end the job."""
        from ckptless.recovery.plan import Assignment

        c = self.ctx
        m = Membership(0, c.world_size, c.master_addr, c.master_port,
                       tuple(Assignment(r, self.worker_id if r == c.rank else f"rank{r}", c.node_id, "survivor")
                             for r in range(c.world_size)))
        self.adopt(m)
        gen = Generation(m, self.worker_id, self.store_for(m))
        gen.mirror_group = groups.bind_all(gen.store, 0, gen.rank, gen.world_size, c.collective_timeout_s,  # type: ignore[arg-type]
                                           time.monotonic() + c.recovery_timeout_s)
        gen.bound = True
        self.gen = gen

    # --- protection ---------------------------------------------------------------------------------
    def protect(self, **objs: Any) -> None:
        """Register Stateful objects (model, optimizer, scheduler, data position, extras).

        RNG streams are protected automatically under the name ``rng``.
        """
        self.registry.protect(**objs)
        self._capturer = None  # the layout changed
        self.make_snapshot_writer()

    def make_snapshot_writer(self) -> None:
        """The periodic snapshot writer, for this rank (once; again after any-rank adoption)."""
        if self.ctx.snapshot_dir and self.ctx.snapshot_every and self.snapshots is None:
            self.snapshots = SnapshotWriter(
                SnapshotConfig(Path(self.ctx.snapshot_dir), self.ctx.job_id, every=self.ctx.snapshot_every),
                self.registry, self.rank, self.world_size)

    @property
    def capturer(self) -> Capturer:
        if self._capturer is None or self._capturer.owner != self.rank:
            self._capturer = Capturer(self.registry, self.ctx.job_id, self.rank, self.mirror_config.chunk_bytes)
        return self._capturer

    def open_peer_store(self) -> PeerStore:
        """Replicas outlive generations; with a node-local shm dir, a respawn re-attaches its predecessor's."""
        if self.peer_store is None:
            if self.ctx.shm_dir:
                self.peer_store = PeerStore.attach(self.ctx.shm_dir, self.ctx.job_id, holder=self.rank,
                                                   node=self.ctx.node_id)
            else:
                self.peer_store = PeerStore(self.ctx.job_id, self.generation)
        return self.peer_store

    def engine(self) -> MirrorEngine | None:
        """This generation's mirror engine (created on first use)."""
        gen = self.gen
        if self.replicas == 0 or gen is None or gen.mirror_group is None:
            return None
        if gen.engine is None:
            gen.engine = MirrorEngine(gen.mirror_group, self.ctx.job_id, self.mirror_config, generation=gen.number,
                                      node_of=gen.node_of, store=self.open_peer_store())
            exit_guard.watch(gen.engine.thread_alive, gen.engine.join)
        return gen.engine

    def capture_and_mirror(self, version: int, pairs: PairSpec = None) -> StateImage:
        """Capture the protected state as ``version`` and hand it to the mirror engine (which fills in
        the returned image's checksums on its thread).

        ``pairs``: None for a full round; ``MISSING`` after a recovery, so that only the
        (owner, holder) pairs whose holder lacks this very image move bytes.
        """
        engine = self.engine()
        if engine is None:
            return self.capturer.capture(version, self.generation)
        reuse.donate_retired(self, engine)  # before acquiring: a retired engine's buffer is faulted in
        buf = engine.acquire_buffer(self.capturer.required_bytes())
        # The training thread waits for the copy only; the engine's thread checksums it.
        image = self.capturer.capture(version, self.generation, out=buf, checksum_now=False)
        engine.submit(image.manifest, image.buffer, pairs)
        return image

    # --- the loop ------------------------------------------------------------------------------------
    def _prepare(self, train_step: Callable[[int], Any] | None, steps: int, start_step: int) -> None:
        if steps < start_step:
            raise ConfigError("steps", steps, f"must be >= start_step ({start_step})")
        if self.spec is not None:
            raise ConfigError("run", steps, "a job trains once: run() or steps() was already called")
        if len(self.registry) <= 1:
            log.warning("ckptless: nothing protected besides RNG; call job.protect(model=..., optimizer=...)")
        else:
            from ckptless.data import protects_data_position

            if not protects_data_position(self.registry) and self.rank == 0:
                log.warning("ckptless: no protected object holds a data position: after a recovery the resumed "
                            "ranks will not replay the same batches unless the batches come from protected state "
                            "(the RNG, a step counter); protect one, e.g. data=ckptless.data.resumable(loader)")
        self.spec = RunSpec(train_step, steps, start_step)
        rank_reads.stop()  # a pre-built spare's setup ends here
        if self.ctx.role == "member" and self.ctx.generation == 0:
            self._write_digest("init")  # only when a chaos runner asked: the state training starts from
        # The script's setup objects (torch's modules, the model) live for the whole job: frozen out
        # of the cyclic GC, the full collection a recovery runs to close the failed generation's
        # sockets (groups.release_all) scans only what was made since, e.g. 0.13-0.3 s -> ~1 ms.
        gc.collect()
        gc.freeze()
        if self.prebuilt and self.seen is None and self.replicas > 0:
            # While it waits for a rank, a warm spare faults in the buffers of its future capture pool
            # (the first one receives its image, which is then mirrored from it): the first-touch page
            # faults of S bytes each are taken off the recovery's critical path and its first steps.
            n = max(1, self.mirror_config.pool_buffers)
            self.standby_buffers = [torch.zeros(self.capturer.required_bytes(), dtype=torch.uint8) for _ in range(n)]

    def registry_step_done(self) -> None:
        """Tell protected objects that track per-step facts (a DDP reducer's phase) that a step ended."""
        self.registry.step_done()

    def steps(self, steps: int, start_step: int = 0) -> Iterator[int]:
        """The loop API: ``for step in job.steps(n):`` with the body inside ``with job.guard():``.

        Yields the step to run next: after a recovery, the resume step (earlier
        steps are run again, exactly as ``run`` does). The guard is required:
        it decides whether an exception in the body is a fault (recovered: the
        next step yielded is the resume step) or the user's own error
        (re-raised: the job fails fast). Locals the body keeps across
        iterations are not protected, as with ``run``'s closures.
        """
        self._prepare(None, steps, start_step)
        it: Generator[int, Event | None, None] = (
            self._drive_steps() if self.recovery else actions.plain_steps(self))  # type: ignore[assignment]
        try:
            step = next(it)
            while True:
                self._guard_outcome = _UNSET
                yield step
                outcome = self._guard_outcome
                if outcome is _UNSET:
                    raise ConfigError("loop", step, "wrap the body of `for step in job.steps(n):` in "
                                                    "`with job.guard():` so that a failure inside it is recovered")
                step = it.send(outcome)
        except StopIteration:
            self._write_digest()
            return

    @contextmanager
    def guard(self) -> Iterator[None]:
        """One step of the loop API: a fault inside is recovered, the user's own error re-raised."""
        try:
            yield
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:
            if not self.recovery:
                raise
            event = actions.classify(self, exc)
            if isinstance(event, UserError):
                exit_file.write("user_error", exit_file.summarize(exc))
                code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
                exit_guard.set_exit_code(code)
                raise
            self._guard_outcome = event  # a fault: suppressed; the loop yields the resume step next
        else:
            self._guard_outcome = None

    def run(self, train_step: Callable[[int], Any], steps: int, start_step: int = 0) -> RunResult:
        """Call ``train_step(step)`` for ``step`` in ``[start_step, steps)``, protected and recovered."""
        self._prepare(train_step, steps, start_step)
        if not self.recovery:
            return actions.run_without_recovery(self)
        self._drive()
        if not is_terminal(self._state):
            raise RecoveryError(f"rank {self.rank}: the worker stopped in state {self._state}")
        self._write_digest()  # the run is over: a script that never calls close() is judged too
        return RunResult(steps - start_step, steps, self.committed_version, self.generation, self.recoveries)

    # --- the end --------------------------------------------------------------------------------------
    def _write_digest(self, name: str = "digest") -> None:
        """The protected state's digest, only when a chaos runner asked (``CKPTLESS_DIGEST_DIR``)."""
        if self.spec is not None:
            from ckptless.state.digest import write_digest

            write_digest(self.registry, self.rank, self.spec.steps, name=name)

    def close(self) -> None:
        """Stop mirroring and snapshots and leave the groups (idempotent)."""
        if not self._closed:
            self._write_digest()
        self._closed = True
        if self.snapshots is not None:
            try:
                self.snapshots.close(timeout=self.ctx.recovery_timeout_s)
            except CkptlessError as exc:  # a last-resort copy failed: report it, the run itself succeeded
                log.warning("rank %d: disk snapshot failed: %s", self.rank, exc)
            self.snapshots = None
        gen = self.gen
        if gen is not None and gen.engine is not None:
            try:
                gen.engine.close(timeout=self.mirror_config.timeout_s)
            except MirrorError:
                log.warning("mirror engine did not stop cleanly", exc_info=True)
            gen.engine = None
        self.ledger.emit(EventKind.JOB_END, generation=self.generation)
        self.ledger.close()
        if gen is not None and gen.bound:
            try:
                dist.barrier()  # nobody tears the groups down under a peer still finishing
            except (RuntimeError, CkptlessError):
                log.info("final barrier failed; leaving anyway", exc_info=True)
        if self.peer_store is not None:
            self.peer_store.close(unlink=True)
        if self.control is not None:
            self.control.close()
            self.control = None
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

    Creates the default ``torch.distributed`` group (do not call
    ``init_process_group`` yourself). A member of the first generation is
    connected to its peers on return; a replacement or spare returns with its
    groups unbound (collectives answer locally) and joins its peers in
    ``run()``, after your script built its objects. A spare blocks here until
    the coordinator assigns it a rank.
    """
    t0 = time.monotonic()
    _enable_crash_stacks()
    ctx = WorkerContext.from_env(env)
    # Before anything of the setup runs: an unseeded script's setup draws the same in every incarnation.
    setup_seed.seed_if_unseeded(os.environ if env is None else env,
                                announce=ctx.rank == 0 and ctx.role == "member" and ctx.generation == 0)
    job = Job(ctx)
    if job.prebuilt:
        rank_reads.start()  # the setup that follows is the standby rank's: does it read its rank?
    log.info("rank %d joined generation %d in %.3fs", job.rank, job.generation, time.monotonic() - t0)
    return job
