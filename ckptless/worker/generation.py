"""Everything one generation gives a worker, in one object with one ``leave()``.

Why: rank, world size and generation used to be copied into several fields
and kept in sync by hand across a recovery. Here they are derived from the
generation's membership; the store connection, the mirror group and the
mirror engine belong to the generation that made them and are dropped
together when it fails. The peer store and the worker's own images outlive
generations (they are what the next one is planned from), so they live in
the driver's :class:`~ckptless.worker.runtime.WorkerRuntime`, not here.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ckptless.errors import RecoveryError
from ckptless.mirror import MirrorEngine
from ckptless.mirror import StoredImage
from ckptless.recovery import Decision
from ckptless.recovery import Received
from ckptless.recovery import Membership
from ckptless.state import StateImage
from ckptless.worker import exit_guard, groups, reaper
from ckptless.worker.mirror_peers import node_of

log = logging.getLogger(__name__)

# Engines of failed generations are kept until their thread has ended: their unregistered mirror
# groups may still have Gloo operations in flight on it, and freeing a group under such an
# operation aborts the process. Once the thread ended, their capture buffers go to the next engine
# or are released (MirrorEngine.release_pool: S per buffer), their group is dropped (its listener
# and Gloo threads with it: MirrorEngine.release_group), and the engine leaves this list.
_RETIRED_ENGINES: list[MirrorEngine] = []


def take_retired_buffers(limit: int, in_use: Collection[int] = ()) -> list[torch.Tensor]:
    """Up to ``limit`` capture buffers of retired engines whose thread has ended, for the next engine.

    Why: a new engine's pool would otherwise allocate fresh buffers on the first
    captures after a recovery, and first-touch page faults of S bytes (about
    0.12 s per 256 MiB here) would land on the first steps. Buffers still
    referenced elsewhere are not taken: ``in_use`` lists their data pointers
    (own images kept for a restore, an image the next engine adopted).
    """
    out: list[torch.Tensor] = []
    for engine in _RETIRED_ENGINES:
        if engine.thread_alive():
            continue
        for t in engine.take_pool():
            if len(out) < limit and t.data_ptr() not in in_use:
                out.append(t)
    return out


def retired_engines_left() -> bool:
    """True while some retired engine still holds its pool or its group (handed over or released later)."""
    return bool(_RETIRED_ENGINES)


def release_retired_buffers() -> int:
    """Release what retired engines whose thread has ended still hold (pool, group) and forget them;
    returns how many are still running. Their mirror groups go to the reaper (their destructors
    join Gloo's threads, which may wait on a dead peer: never on the training thread)."""
    running = 0
    dropped: list[object] = []
    for engine in list(_RETIRED_ENGINES):
        if engine.thread_alive():
            running += 1
            continue
        engine.release_pool()
        group = engine.release_group()
        if group is not None:
            dropped.append(group)
        _RETIRED_ENGINES.remove(engine)
    if dropped:
        reaper.drop("retired mirror groups", dropped)
    return running


@dataclass
class Generation:
    membership: Membership
    worker_id: str
    store: dist.Store | None = None
    mirror_group: dist.ProcessGroup | None = None
    engine: MirrorEngine | None = None
    bound: bool = False
    # What forming this generation produced for its restore (both die with the generation):
    restored_early: StateImage | None = None  # the own image a survivor rolled back to while it formed
    transfers_done: bool = False  # the plan's transfers ran (or were collected) before the user's groups
    received: Received | None = None  # what those transfers brought this rank

    @property
    def number(self) -> int:
        return self.membership.generation

    @property
    def rank(self) -> int:
        r = self.membership.rank_of(self.worker_id)
        if r is None:
            raise RecoveryError(f"worker {self.worker_id} has no rank in generation {self.number}")
        return r

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    @property
    def physical(self) -> tuple[int, int] | None:
        """This process's ``(index, count)`` among the processes of a generation with fewer ranks (some
        rank hosted by a survivor), whose communicators span the processes only; None otherwise."""
        return self.membership.physical(self.worker_id)

    @property
    def hosted(self) -> list[int]:
        """The lost ranks this process runs micro-batches for in this generation (fewer ranks)."""
        return self.membership.hosted_by(self.worker_id)

    @property
    def decision(self) -> Decision | None:
        return self.membership.decision

    @property
    def node_of(self) -> list[str]:
        return node_of(self.membership)  # O(W): a lookup per rank would be O(W^2)

    def leave(self) -> list[StoredImage]:
        """Drop this generation's communicators at once; return the own images its engine still held.

        Peers blocked on us are released (our sockets close); the engine is
        retired, not freed. Must be called outside an ``except`` block.
        """
        own: list[StoredImage] = []
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.retire()
            _RETIRED_ENGINES.append(engine)
            exit_guard.watch(engine.thread_alive, engine.join)
            own = engine.own_images()
        groups.release_all(self.number)
        self.mirror_group = None
        self.bound = False
        # No join and no release here: the retired thread ends once its round fails (its peers are
        # gone), and waiting for it would put its current operation on every recovery's critical
        # path. Its pool goes to the next engine once it has ended (worker/reuse.py), the rest is
        # released then; ``own`` keeps the images a restore needs alive either way.
        return own
