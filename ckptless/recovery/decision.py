"""What a recovery decision is: the four outcomes and the parts a plan is made of.

Why its own module: these frozen records are the contract between the pure
planner (:mod:`ckptless.recovery.plan`, which makes them), the wire format
(:mod:`ckptless.recovery.wire`, which puts them in etcd), the leader, and every
worker that executes one (:mod:`ckptless.recovery.executor`,
:mod:`ckptless.recovery.transfer`). Those readers need what a decision *says*,
never the rules that chose it, so the records stand apart from the rules and
depend on nothing but the error types. The rule numbers (R0..R11) refer to
docs/recovery.md and the planner's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NoReturn, Union

from ckptless.errors import UnrecoverableError

Source = Literal["survivor", "spare", "respawn", "hosted"]
"""Where a rank's worker came from; ``hosted``: no process of its own, a survivor (the assignment's
worker) runs its micro-batches in a generation with fewer ranks (:mod:`ckptless.recovery.shrink`)."""


@dataclass(frozen=True)
class Assignment:
    """Who runs ``rank`` in the new generation and where it came from."""

    rank: int
    worker_id: str
    node_id: str
    source: Source


@dataclass(frozen=True)
class Stripe:
    """Chunks ``[start, stop)`` of ``owner``'s image, fetched from ``source``.

    If the stripe fails its checksum (or the source dies), the receiver tries
    ``fallbacks`` in order; all of them hold the same version complete.
    ``own``: the sources serve these chunks from their *own* image of that
    version (live replicas of the owner's replicated prefix,
    :mod:`ckptless.state.replication`), not from a replica they hold.
    """

    owner: int
    start: int
    stop: int
    source: str
    fallbacks: tuple[str, ...]
    own: bool = False

    @property
    def n_chunks(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Transfer:
    """How rank ``owner`` (a replacement, or a worker lacking R) gets version R."""

    owner: int
    receiver: str
    version: int
    n_chunks: int
    holders: tuple[str, ...]
    stripes: tuple[Stripe, ...]


@dataclass(frozen=True)
class LocalRestore:
    """R9: rank ``rank``'s new worker (a respawn on ``node_id``) restores ``version`` from the
    node-local image its predecessor left there (``n_chunks`` chunks, captured in ``generation``)."""

    rank: int
    worker_id: str
    node_id: str
    version: int
    n_chunks: int
    generation: int


@dataclass(frozen=True)
class Adoption:
    """R11: live worker ``worker_id`` on ``node_id`` takes the copy of ``owner``'s image at ``version``
    that ``holder``'s files keep in that node's node-local tier (``holder == owner``: that rank's own
    image), left there by a worker that died; it checks every chunk and from then on holds the copy
    like a replica it was sent: it serves the plan's stripes for it, or hosts ``owner`` from it."""

    worker_id: str
    owner: int
    holder: int
    node_id: str
    version: int
    n_chunks: int
    generation: int


@dataclass(frozen=True)
class Rollback:
    """A survivor that captured past R and must restore R from local memory."""

    rank: int
    worker_id: str
    from_version: int
    to_version: int


@dataclass(frozen=True)
class RecoveryPlan:
    """Recover from peer memory: the normal, fast path."""

    job_id: str
    generation: int
    assignments: tuple[Assignment, ...]
    lost_ranks: tuple[int, ...]
    resume_version: int
    rollbacks: tuple[Rollback, ...]
    transfers: tuple[Transfer, ...]
    replace_mirrors: bool
    owners_below_k: tuple[int, ...]
    steps_lost: int
    initial_ranks: tuple[int, ...] = ()  # R0: these ranks start from their freshly built state
    # R2: these ranks go to a pre-built spare built as another rank of the same layout, which
    # receives their image into the objects it built (no re-exec, no setup on the critical path)
    adopt_prebuilt: tuple[int, ...] = ()
    node_local: tuple[LocalRestore, ...] = ()  # R9: these ranks restore from node-local memory
    adoptions: tuple[Adoption, ...] = ()  # R11: copies live workers take from their node's tier first
    stalled: int = 0  # recoveries in a row before this one that resumed no later (leader_machine: the give-up rule)
    timeouts: int = 0  # of those (this one included), ended by a collective timeout alone (give_up.timeouts)

    @property
    def resume_step(self) -> int:
        """Training resumes with the step after the resumed version."""
        return self.resume_version + 1

    @property
    def rank_to_worker(self) -> dict[int, str]:
        return {a.rank: a.worker_id for a in self.assignments}

    @property
    def hosted(self) -> dict[int, str]:
        """Lost rank -> the survivor worker that runs its micro-batches (fewer ranks; empty otherwise)."""
        return {a.rank: a.worker_id for a in self.assignments if a.source == "hosted"}


@dataclass(frozen=True)
class DiskFallback:
    """Memory cannot cover the loss: every rank restores ``snapshot_step`` from disk."""

    job_id: str
    generation: int
    assignments: tuple[Assignment, ...]
    lost_ranks: tuple[int, ...]
    snapshot_step: int
    reason: str
    lost_ranks_without_replica: tuple[int, ...]
    steps_lost: int
    stalled: int = 0  # as RecoveryPlan.stalled
    timeouts: int = 0  # as RecoveryPlan.timeouts

    @property
    def rank_to_worker(self) -> dict[int, str]:
        return {a.rank: a.worker_id for a in self.assignments}

    @property
    def resume_version(self) -> int:
        """The version training resumes from (the snapshot's step: a comparable point for the give-up rule)."""
        return self.snapshot_step


@dataclass(frozen=True)
class WaitForReplacement:
    """Recoverable, but some lost rank has no worker yet; re-plan when one joins.

    The generation is *not* bumped: nothing has been decided yet.
    """

    job_id: str
    generation: int
    unassigned_ranks: tuple[int, ...]
    then: Literal["memory", "disk"]
    reason: str


@dataclass(frozen=True)
class Unrecoverable:
    """Neither peer memory nor disk holds a complete image of every rank."""

    job_id: str
    generation: int
    reason: str
    lost_ranks_without_replica: tuple[int, ...]

    def raise_error(self) -> NoReturn:
        raise UnrecoverableError(f"job {self.job_id} gen {self.generation}: {self.reason}")


Decision = Union[RecoveryPlan, DiskFallback, WaitForReplacement, Unrecoverable]
