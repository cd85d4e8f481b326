"""What one worker process carries between the actions of its machine, in one declared object.

Why: the executors used to read and write some thirty-five attributes of the
user's ``Job``, among them loose recovery flags ("first step after a
recovery", "restored early", "received ahead", "the last restore failed").
Here the state the machine's *driver* owns is declared in one place, with
what each field means and who writes it:

* what outlives generations (the peer store, the own images, the committed
  version, the snapshot writer) lives in :class:`WorkerRuntime`;
* what one generation produced for the next action of the same generation
  (the image rolled back to while forming, the bytes received ahead) lives on
  its :class:`~ckptless.worker.generation.Generation` and dies with it;
* what the next report must tell the leader lives in :class:`ReportNotes`;
* facts of one training action (the resume version, the first step after a
  recovery) are not stored at all: they are the ``Train`` action's own fields.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptless import chaos_hooks, environment
from ckptless.errors import NodeCopyError, TransportError
from ckptless.goodput import EventKind
from ckptless.mirror import MirrorConfig
from ckptless.mirror import MirrorEngine
from ckptless.mirror import PairSpec
from ckptless.mirror import attach
from ckptless.mirror import StrikeBook
from ckptless.mirror import PeerStore, StoredImage
from ckptless.recovery import Received
from ckptless.recovery import Membership
from ckptless.snapshot import SnapshotConfig, SnapshotWriter
from ckptless.state import Capturer, GradientWindow, StateImage, StateRegistry, WriteOrder, window
from ckptless.worker import deferral, exit_guard, groups, rank_reads, reuse
from ckptless.worker.context import WorkerContext
from ckptless.worker.control import WorkerControl
from ckptless.worker.generation import Generation
from ckptless.worker.heartbeat import Heartbeat
from ckptless.worker.hosted import MicroBatches
from ckptless.worker.ledger import WorkerLedger
from ckptless.worker.machine import Event

log = logging.getLogger(__name__)


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


@dataclass
class ReportNotes:
    """What the next failure report adds to the replicas it lists (reset by a successful restore)."""

    recheck: bool = False  # the last restore failed: re-read every replica's checksums before reporting
    bad_snapshot: int | None = None  # the disk snapshot of this step failed to load: the plan must skip it
    bad_copies: tuple[tuple[str, int, int, int], ...] = ()  # node-local copies that failed adoption (R11)

    def failed(self, exc: BaseException | None = None, bad_snapshot: int | None = None) -> ReportNotes:
        """After a failed restore: re-read every replica, and name what failed (kept until a restore succeeds)."""
        copies = self.bad_copies + ((exc.key,) if isinstance(exc, NodeCopyError) and exc.key not in self.bad_copies
                                    else ())
        return ReportNotes(True, self.bad_snapshot if bad_snapshot is None else bad_snapshot, copies)


@dataclass
class TransferAhead:
    """A replacement's transfers, started in ``init()`` while its script runs its setup."""

    generation: int
    thread: threading.Thread
    received: Received | None = None
    error: BaseException | None = None


class Keep(Enum):
    """A field of :class:`Changed` left as it is (``None`` is a value some fields take)."""

    KEEP = "keep"


KEEP = Keep.KEEP


@dataclass(frozen=True)
class Changed:
    """What one executor did: the event it ends with and the runtime fields it changed.

    Why: the driver is the one writer of the per-worker state (issue 40). An
    executor reads the runtime and returns what it changed; the driver applies
    it (:meth:`WorkerRuntime.apply`) before it feeds the event to the machine.
    Built once per action, never per step.
    """

    event: Event | None = None
    adopt: Membership | None = None  # a membership that includes this worker: the driver adopts it (``seen``)
    gen: Generation | Keep = KEEP  # the generation being formed (set even if forming it fails)
    notes: ReportNotes | Keep = KEEP
    own_images: list[StoredImage] | Keep = KEEP
    trained: int | Keep = KEEP
    recovered: bool = False  # one more recovery restored (``recoveries``)
    micro: MicroBatches | None | Keep = KEEP
    committed: int | None | Keep = KEEP
    standby_buffers: list[torch.Tensor] | Keep = KEEP
    transfer_ahead: TransferAhead | None | Keep = KEEP

    @staticmethod
    def of(outcome: Event | Changed | None) -> Changed:
        return outcome if isinstance(outcome, Changed) else Changed(outcome)


class WorkerRuntime:
    """One worker's resources and the state its driver carries across generations.

    The executors (:mod:`ckptless.worker.actions` and the modules it dispatches
    to) act on this object and nothing else; the user's :class:`~ckptless.job.Job`
    only holds it. Identity (rank, world size, generation) is derived from the
    newest membership that includes this worker, never copied.
    """

    def __init__(self, ctx: WorkerContext, mirror_config: MirrorConfig | None, heartbeat_file: str | None) -> None:
        self.ctx = ctx
        self.worker_id = ctx.worker_id
        self.registry = StateRegistry()
        # One process cannot mirror to a peer: K is capped at world size - 1.
        self.replicas = min(ctx.replicas, ctx.world_size - 1)
        self.recovery = bool(ctx.etcd_endpoint) and self.replicas > 0
        self.prebuilt = self.recovery and ctx.standby_rank is not None  # a warm spare that builds as a rank
        self.mirror_config = mirror_config or MirrorConfig.build(
            replicas=max(self.replicas, 1), mirror_every=ctx.mirror_every, placement=ctx.placement,
            shm_dir=ctx.shm_dir, timeout_s=ctx.collective_timeout_s, pool_buffers=ctx.mirror_buffers,
            on_replica_mismatch=ctx.on_replica_mismatch,
        )
        self.heartbeat = Heartbeat(heartbeat_file)
        self.ledger = WorkerLedger(ctx.goodput_dir, None if ctx.role == "spare" else ctx.rank)
        self.control: WorkerControl | None = None
        if self.recovery:
            assert ctx.etcd_endpoint is not None
            self.control = WorkerControl(ctx.etcd_endpoint, ctx.job_id, ctx.worker_id, relay_path=ctx.control_relay)
            self.control.mark_ported()
        self.seen: Membership | None = None  # the newest membership that includes this worker
        self.gen: Generation | None = None  # the generation it is in (or formed last)
        self.peer_store: PeerStore | None = None  # the replicas it holds for its peers: outlive generations
        self.own_images: list[StoredImage] = []  # its committed images, kept from a failed generation
        self.committed: int | None = None  # the committed version when its last engine was retired
        self.snapshots: SnapshotWriter | None = None
        self.spec: RunSpec | None = None  # what run()/steps() was asked to train
        self.user_exception: BaseException | None = None  # the user's error, re-raised from run()
        self.recoveries = 0
        self.trained: int | None = None  # the newest version this process trained to (None: none yet)
        self.notes = ReportNotes()
        self.strikes = StrikeBook()  # ranks this process saw replaced for corruption (mirror/replica_check.py)
        self.transfer_ahead: TransferAhead | None = None
        # A pre-built spare's receive buffer and further pool buffers, faulted in while it waits.
        self.standby_buffers: list[torch.Tensor] = []
        self._capturer: Capturer | None = None
        # Where the next step waits (on the GPU) for the last capture's device-to-host copies.
        step_order = environment.current().capture_order == "step"
        self.write_order = WriteOrder(always_at_start=step_order)
        self.write_order.before_optimizer = self._settle_prefix
        # Whether a version lies inside a gradient-accumulation window (not protected: state/window.py).
        self.window = GradientWindow()
        self.snapshot_owed = False  # a due snapshot step fell inside a window: the next clean step takes it
        self.mirror_owed = False  # the same for a version due to be mirrored (--mirror-every)
        self.last_protected: int | None = None  # the newest version captured and mirrored in this training
        # Why this process captures whole images from now on, instead of leaving the prefix live.
        self.defer_off: str | None = "CKPTLESS_CAPTURE_ORDER=step" if step_order else None
        self._store: tuple[tuple[str, int], dist.Store] | None = None
        # (generation, address) of a store that did not answer: its host is gone (issue 35: the leader's node,
        # lost just after it published); forming that generation then fails at once, not after another timeout
        self._unreachable: tuple[int, tuple[str, int]] | None = None
        # A generation with fewer ranks: the lost ranks this process runs micro-batches for (worker/hosted.py).
        self.micro: MicroBatches | None = None

    def apply(self, c: Changed) -> None:
        """Write what an executor changed (called by the driver only)."""
        if c.gen is not KEEP:
            self.gen = c.gen
        if c.notes is not KEEP:
            self.notes = c.notes
        if c.own_images is not KEEP:
            self.own_images = c.own_images
        if c.trained is not KEEP:
            self.trained = c.trained
        if c.recovered:
            self.recoveries += 1
        if c.micro is not KEEP:
            self.micro = c.micro
        if c.committed is not KEEP:
            self.committed = c.committed
        if c.standby_buffers is not KEEP:
            self.standby_buffers = c.standby_buffers
        if c.transfer_ahead is not KEEP:
            self.transfer_ahead = c.transfer_ahead

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

    # --- stores and groups ------------------------------------------------------------------------
    def store_for(self, m: Membership) -> dist.Store:
        addr = (m.store_host, m.store_port)
        if self._store is None or self._store[0] != addr:
            if self._unreachable == (m.generation, addr):  # one connect timeout per generation, not one per step
                raise TransportError(f"generation {m.generation}'s store at {addr[0]}:{addr[1]} was unreachable")
            try:
                self._store = (addr, groups.connect_store(addr[0], addr[1], self.ctx.collective_timeout_s))
            except TransportError:
                self._unreachable = (m.generation, addr)
                raise
        return self._store[1]

    def forget_store(self) -> None:
        """Drop the cached store client: the next generation connects a fresh one."""
        self._store = None

    def incident_check(self) -> Callable[[int], bool] | None:
        """The control plane's "was generation g declared failed?" (None without a coordinator)."""
        return self.control.incident if self.control is not None else None

    # --- protection -----------------------------------------------------------------------------------
    def make_snapshot_writer(self) -> None:
        """The periodic snapshot writer, for this rank (once; again after any-rank adoption)."""
        if self.ctx.snapshot_dir and self.ctx.snapshot_every and self.snapshots is None:
            self.snapshots = SnapshotWriter(
                SnapshotConfig(Path(self.ctx.snapshot_dir), self.ctx.job_id, every=self.ctx.snapshot_every),
                self.registry, self.rank, self.world_size)

    def renew_snapshot_writer(self) -> None:
        """A spare took another rank as built: its snapshot writer (if any) is made anew, for that rank."""
        if self.snapshots is not None:
            self.snapshots.close()
            self.snapshots = None
            self.make_snapshot_writer()

    def layout_changed(self) -> None:
        """New objects were protected: the next capture plans its layout anew, and every protected
        optimizer's step orders itself after the capture's copies (``state/fence.py``)."""
        self._capturer = None
        self.write_order.install(obj for _, obj in self.registry.items())
        self.window.install(obj for _, obj in self.registry.items())

    @property
    def capturer(self) -> Capturer:
        if self._capturer is None or self._capturer.owner != self.rank:
            # One pool buffer means no rank keeps the committed version while it captures the next, so
            # no live replica could serve a lost rank's replicated prefix: holders then keep it too
            # (as with --mirror-replicated, for jobs that must survive losing every replica at once).
            self._capturer = Capturer(self.registry, self.ctx.job_id, self.rank, self.mirror_config.chunk_bytes,
                                      timeout_s=self.mirror_config.timeout_s,
                                      mirror_replicated=self.ctx.mirror_replicated or self.mirror_config.pool_buffers < 2)
        return self._capturer

    def open_peer_store(self) -> PeerStore:
        """Replicas outlive generations; with a node-local shm dir, a respawn re-attaches its predecessor's."""
        if self.peer_store is None:
            if self.ctx.shm_dir:
                self.peer_store = attach(self.ctx.shm_dir, self.ctx.job_id, holder=self.rank, node=self.ctx.node_id)
            else:
                self.peer_store = PeerStore(self.ctx.job_id, self.generation)
        return self.peer_store

    def engine(self) -> MirrorEngine | None:
        """This generation's mirror engine (created on first use)."""
        gen = self.gen
        if self.replicas == 0 or gen is None or gen.mirror_group is None or gen.physical is not None:
            return None  # (a generation with fewer ranks is not mirrored: docs/failure-model.md, "Fewer ranks")
        if gen.engine is None:
            gen.engine = MirrorEngine(gen.mirror_group, self.ctx.job_id, self.mirror_config, generation=gen.number,
                                      node_of=gen.node_of, store=self.open_peer_store(), strikes=self.strikes)
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
        reuse.donate_retired(self.own_images, engine)  # before acquiring: a retired engine's buffer is faulted in
        chaos_hooks.flip_point(f"flip:r{self.rank}:{version}", self.registry, self.rank)  # chaos runs only: a bit flip
        plan = self.capturer.plan()  # the state collected once per capture
        if engine.live_torn is not None and self.defer_off is None:
            self.defer_off = engine.live_torn
        defer = deferral.may_defer(engine, plan, self.write_order.optimizers, self.capturer.mirror_replicated,
                                   self.defer_off, self.mirror_config.timeout_s)
        buf = engine.acquire_buffer(plan.nbytes(defer), shrink=defer)
        # The training thread waits for no copy: CPU tensors are copied here, device tensors on side
        # streams (the next step waits for them on the GPU, where it would overwrite them); the engine's
        # thread waits for them and checksums the image. A deferred capture copies its suffix alone.
        image = self.capturer.capture(version, self.generation, out=buf, checksum_now=False, plan=plan,
                                      defer_prefix=defer)
        self.write_order.captured(image.fence)  # first: whatever happens next, a leave drains these copies
        chaos_hooks.pause_point(f"capture:r{self.rank}:{version}", rank=self.rank, version=version)
        engine.submit(image.manifest, image.buffer, pairs, fence=image.fence, live=image.live)
        return image

    def _settle_prefix(self) -> None:
        """Before every protected optimizer step: a deferred capture's round must be over (mirror/pool.py)."""
        engine = self.gen.engine if self.gen is not None else None
        if engine is not None:
            engine.settle_prefix(self.mirror_config.timeout_s)

    def step_done(self, step: int, generation: int, mirrored: bool = True) -> None:
        """After step ``step`` completed: per-step facts and the heartbeat.

        ``mirrored``: the heartbeat also tells the agent the generation, the committed version and
        the replica bytes held (a job without recovery has none of them)."""
        self.registry.step_done()  # protected objects that track per-step facts (a DDP reducer's phase)
        self.trained = step
        if mirrored:
            self.heartbeat.beat(step, generation=generation, committed=self.committed_version,
                                replica_bytes=self.peer_store.bytes_held if self.peer_store is not None else 0,
                                own_bytes=self.gen.engine.pool_bytes() if self.gen and self.gen.engine else 0)
        else:
            self.heartbeat.beat(step)

    # --- gradient-accumulation windows (state/window.py): the protection bookkeeping, owned here -------
    def start_windows_at(self, step: int) -> None:
        """Training starts at version ``step`` (the initial one, a restore): nothing owed, ``step``
        protected, no optimizer stepped since (the same on every rank)."""
        self.window.reset()
        self.mirror_owed, self.snapshot_owed, self.last_protected = False, False, step

    def mirror_now(self, due: bool, clean: bool, final: bool) -> bool:
        """Is the version just closed to be captured and mirrored now? A due one inside a window is
        owed to the window's end."""
        now, self.mirror_owed = window.decide(due, clean, self.mirror_owed, final=final)
        return now

    def protected_at(self, version: int) -> None:
        """``version`` was captured and mirrored: the newest protected in this training."""
        self.last_protected = version

    def maybe_snapshot(self, step: int, generation: int, clean: bool = True) -> None:
        """The periodic disk snapshot, when ``step`` is due (the last resort, see ckptless.snapshot).
        ``clean``: False inside a gradient-accumulation window, whose due snapshot is then taken at
        the next clean step instead (``state/window.py``)."""
        w = self.snapshots
        if w is None:
            return
        due = w.due(step)
        take, self.snapshot_owed = window.decide(due, clean, self.snapshot_owed, final=False)
        if take:
            started = w.snapshot(step, generation)
        else:
            started = not due and w.maybe_snapshot(step, generation)  # (not due: it prefaults its buffer)
        if started:
            self.ledger.emit(EventKind.SNAPSHOT_SAVED, step=step, generation=generation, block_s=w.last_block_s)
