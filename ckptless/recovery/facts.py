"""Typed, validated input records for recovery planning.

Why a separate module of plain records: the planner must be a pure function
of *reported facts* (DESIGN: "recovery must not guess"). Keeping the facts in
frozen dataclasses that validate themselves on construction means every
inconsistency (a rank held twice, a report from a worker nobody knows, three
versions of one replica) is rejected at the boundary with a ``ConfigError``
naming the field, instead of surfacing as a wrong plan later.

Nothing here performs I/O; the coordinator gathers these facts from etcd and
the peer stores and hands them to :func:`ckptless.recovery.plan.plan_recovery`.
"""

from __future__ import annotations

import functools

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ckptless.errors import ConfigError
from ckptless.state import ReplicaSet

#: How many complete versions of one owner's image a holder keeps (double buffer).
MAX_VERSIONS_PER_OWNER = 2

Preference = Literal["spare", "respawn"]
LostNode = Literal["wait", "shrink"]


@dataclass(frozen=True)
class Worker:
    """A process that can hold a rank: an opaque id (e.g. ``node3/w1``) on a node.

    ``standby_rank`` (spares only): the rank this spare already built the
    script's objects for; it takes that rank without re-running setup.
    ``any_rank`` (pre-built spares only): its script declared a rank-independent
    setup (``--spare-any-rank``), so it may also take any rank whose image has
    its standby rank's layout (R2, :mod:`ckptless.state.layout`).
    """

    worker_id: str
    node_id: str
    standby_rank: int | None = None
    any_rank: bool = False

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ConfigError("worker_id", self.worker_id, "must be a non-empty string")
        if not self.node_id:
            raise ConfigError("node_id", self.node_id, f"worker {self.worker_id!r} needs a node")


@dataclass(frozen=True)
class RankSlot:
    """Who held ``rank`` in the current generation, and whether it is still alive."""

    rank: int
    worker: Worker
    alive: bool

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError("rank", self.rank, "must be >= 0")


@dataclass(frozen=True)
class ReplicaFact:
    """One version of another rank's image that a holder has *complete and verified*.

    ``n_chunks`` is the image size in chunks for that version; the transfer
    plan stripes over chunk indices ``[0, n_chunks)``. ``layout``: the image's
    layout key (:mod:`ckptless.state.layout`; "" when unknown), which tells the
    planner which pre-built spares fit the owner's objects.
    """

    owner: int
    version: int
    n_chunks: int
    layout: str = ""
    first_chunk: int = 0  # the holder keeps chunks [first_chunk, n_chunks): the rest is replicated
    peers: ReplicaSet | None = None  # who holds [0, first_chunk) identically (their own images), if any

    def __post_init__(self) -> None:
        if not 0 <= self.first_chunk <= self.n_chunks or (self.first_chunk > 0) != (self.peers is not None):
            raise ConfigError("replica.first_chunk", self.first_chunk,
                              f"must lie in [0, {self.n_chunks}] and come with its replica peers iff > 0")
        if self.owner < 0:
            raise ConfigError("replica.owner", self.owner, "must be >= 0")
        if self.version < 0:
            raise ConfigError("replica.version", self.version, "must be >= 0")
        if self.n_chunks < 0:
            raise ConfigError("replica.n_chunks", self.n_chunks, "must be >= 0")


@dataclass(frozen=True)
class NodeLocalImage:
    """A complete copy of ``rank``'s own image that survived its worker on ``node_id`` (node-local tier).

    Reported by that node's agent in the dead worker's exit record, after it
    checksummed every chunk: version ``version`` (captured in generation
    ``generation``), ``n_chunks`` chunks. Only a worker started on the same
    node can read it.
    """

    rank: int
    node_id: str
    version: int
    n_chunks: int
    generation: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "version", "n_chunks", "generation"):
            if getattr(self, name) < 0:
                raise ConfigError(f"node_local.{name}", getattr(self, name), "must be >= 0")
        if not self.node_id:
            raise ConfigError("node_local.node_id", self.node_id, "must be a non-empty string")


@dataclass(frozen=True)
class NodeLocalCopy:
    """A verified copy of ``owner``'s image that a dead worker left in node ``node_id``'s node-local tier.

    ``holder`` is the rank whose files keep it: ``holder == owner`` is that rank's own committed
    image (:mod:`ckptless.mirror.ownimage`), any other holder a replica it held
    (:mod:`ckptless.mirror.slot_files`: a mirrored copy, or a hosted rank's image handed over when a
    generation with fewer ranks grew back). The agent of that node checksummed every chunk when it
    reaped the worker and wrote it in the exit record. Why its own fact, beside
    :class:`NodeLocalImage`: a respawn of the rank on that node is not the only process that can read
    it; any live worker on the node can map the file and then holds the copy like a replica
    (:class:`~ckptless.recovery.decision.Adoption`). Without it a lost host's replicas, which its
    node kept, counted as gone (issue 35).
    """

    owner: int
    holder: int
    node_id: str
    version: int
    n_chunks: int
    generation: int = 0
    layout: str = ""
    first_chunk: int = 0  # as in ReplicaFact: the copy keeps [first_chunk, n_chunks) only
    peers: ReplicaSet | None = None

    def __post_init__(self) -> None:
        for name in ("owner", "holder", "generation"):
            if getattr(self, name) < 0:
                raise ConfigError(f"node_copy.{name}", getattr(self, name), "must be >= 0")
        if not self.node_id:
            raise ConfigError("node_copy.node_id", self.node_id, "must be a non-empty string")
        self.fact  # validates version, n_chunks, first_chunk and peers the way a replica's are

    @property
    def fact(self) -> ReplicaFact:
        """The copy as the replica fact a live holder reports once it holds it."""
        return ReplicaFact(self.owner, self.version, self.n_chunks, self.layout, self.first_chunk, self.peers)

    @property
    def key(self) -> tuple[str, int, int, int]:
        """Where it is and what: (node, holder, owner, version); one copy per key."""
        return (self.node_id, self.holder, self.owner, self.version)


@dataclass(frozen=True)
class WorkerReport:
    """What one live worker says about the images it holds.

    ``local_versions`` are the versions of its *own* rank's image it can
    restore from local memory (a survivor keeps its committed version and
    anything newer it captured). A freshly admitted replacement that has not
    finished restoring reports ``local_versions=frozenset()`` and ``None`` for
    both versions: the planner then treats its rank as needing an image,
    exactly like a lost rank (this is what makes a failure *during* recovery
    plannable from facts alone). ``own_layouts``: ``(version, layout key)`` of
    its own images (:mod:`ckptless.state.layout`); with the replicas' keys they
    tell the planner which pre-built spares fit which rank, also for a rank
    whose only holder is the one that died.
    ``can_host``: its state can run another rank's micro-batches (a DDP job, checked by the worker:
    :func:`ckptless.worker.hosted.why_not_shrinkable`), so it may host a lost rank (fewer ranks).
    """

    worker_id: str
    newest_captured: int | None
    committed: int | None
    local_versions: frozenset[int] = frozenset()
    replicas: tuple[ReplicaFact, ...] = ()
    own_layouts: tuple[tuple[int, str], ...] = ()
    can_host: bool = False

    def __post_init__(self) -> None:
        where = f"report[{self.worker_id}]"
        if any(v < 0 for v in self.local_versions):
            raise ConfigError(f"{where}.local_versions", sorted(self.local_versions), "negative version")
        newest = max(self.local_versions, default=None)
        if newest != self.newest_captured:
            raise ConfigError(f"{where}.newest_captured", self.newest_captured,
                              f"must equal the newest local version ({newest})")
        if self.committed is not None:
            if self.committed not in self.local_versions:
                raise ConfigError(f"{where}.committed", self.committed,
                                  "a worker always keeps its committed version locally")
            if any(v < self.committed for v in self.local_versions):
                raise ConfigError(f"{where}.local_versions", sorted(self.local_versions),
                                  f"holds versions older than its committed {self.committed}")
        seen: dict[int, set[int]] = {}
        for rep in self.replicas:
            versions = seen.setdefault(rep.owner, set())
            if rep.version in versions:
                raise ConfigError(f"{where}.replicas", (rep.owner, rep.version), "duplicate replica")
            versions.add(rep.version)
            if len(versions) > MAX_VERSIONS_PER_OWNER:
                raise ConfigError(f"{where}.replicas", (rep.owner, sorted(versions)),
                                  f"at most {MAX_VERSIONS_PER_OWNER} versions per owner")

    def replica_versions(self, owner: int) -> frozenset[int]:
        """Complete versions of ``owner``'s image this worker holds."""
        return frozenset(r.version for r in self.replicas if r.owner == owner)


@dataclass(frozen=True)
class PlanPolicy:
    """Knobs that change *which* valid plan is chosen, never its validity.

    ``prefer``: whether a lost rank goes first to a warm spare (fast, ~0.1 s)
    or to a respawn on its own node (keeps locality, costs a cold start).
    ``resume_beyond_committed``: whether a version newer than every reported
    commit may be resumed from when the facts show it complete for every
    rank. The commit record only *announces* completeness and can lag; when
    False the planner never resumes past the newest reported commit.
    ``lost_node``: what to do when a lost rank has no spare and no node to
    respawn on: ``wait`` for one, or ``shrink`` (go on with fewer ranks, the
    survivors hosting the lost ranks' micro-batches, :mod:`ckptless.recovery.shrink`)
    while at least ``min_nodes`` nodes run ranks (``--nnodes MIN:MAX``).
    """

    prefer: Preference = "spare"
    resume_beyond_committed: bool = True
    lost_node: LostNode = "wait"
    min_nodes: int = 1

    def __post_init__(self) -> None:
        if self.prefer not in ("spare", "respawn"):
            raise ConfigError("policy.prefer", self.prefer, "must be 'spare' or 'respawn'")
        if self.lost_node not in ("wait", "shrink"):
            raise ConfigError("policy.lost_node", self.lost_node, "must be 'wait' or 'shrink'")
        if self.min_nodes < 1:
            raise ConfigError("policy.min_nodes", self.min_nodes, "must be >= 1")


@dataclass(frozen=True)
class PlanningFacts:
    """Everything the planner may look at, for one job at one generation.

    ``placement`` maps each owner rank to the ranks meant to hold its mirrors
    (the placement function lives in ``ckptless.mirror``); it is used for
    locality preferences and to report which owners fell below K. What is
    actually *held* is taken from the reports only.

    ``dead_nodes`` are nodes known to be lost: ranks there cannot respawn and
    spares there are ignored.

    ``node_local`` are the own images lost ranks left in node-local memory
    (at most one per lost rank, on that rank's node): a respawn there can
    restore from it instead of pulling it from peers.

    ``no_respawn`` are lost ranks their own node cannot start again: the rank's
    GPU failed (a GPU-class exit) and its agent found no other good GPU free
    there, as its exit record says. They take a spare or wait; a respawn
    would meet the failed device again.

    ``node_copies`` are the copies of any rank's image that dead workers left in the node-local tier
    of nodes still alive (their own images and the replicas they held, :class:`NodeLocalCopy`): a
    live worker on that node adopts one when no live process holds that image (R11).

    ``last_resume`` is the version the current generation's plan resumed at
    (None at generation 0): what the coordinator itself knows was committed,
    when every live worker is a replacement that has not restored yet and so
    reports nothing (a recovery interrupted by a further failure).
    """

    job_id: str
    generation: int
    world_size: int
    members: tuple[RankSlot, ...]
    reports: tuple[WorkerReport, ...]
    spares: tuple[Worker, ...] = ()
    placement: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    snapshot_step: int | None = None
    dead_nodes: frozenset[str] = frozenset()
    policy: PlanPolicy = PlanPolicy()
    node_local: tuple[NodeLocalImage, ...] = ()
    last_resume: int | None = None
    no_respawn: frozenset[int] = frozenset()
    node_copies: tuple[NodeLocalCopy, ...] = ()

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ConfigError("job_id", self.job_id, "must be non-empty")
        if self.generation < 0:
            raise ConfigError("generation", self.generation, "must be >= 0")
        if self.world_size < 1:
            raise ConfigError("world_size", self.world_size, "must be >= 1")
        if self.snapshot_step is not None and self.snapshot_step < 0:
            raise ConfigError("snapshot_step", self.snapshot_step, "must be >= 0 or None")
        self._check_members()
        self._check_reports()
        self._check_placement()
        self._check_node_local()
        self._check_node_copies()
        for rank in sorted(self.no_respawn):
            if not 0 <= rank < self.world_size or self.slot(rank).alive:
                raise ConfigError("no_respawn", rank, "only a lost rank can be barred from a respawn")

    def _check_members(self) -> None:
        ranks = sorted(s.rank for s in self.members)
        if ranks != list(range(self.world_size)):
            raise ConfigError("members", ranks, f"must hold each rank 0..{self.world_size - 1} once")
        ids = [s.worker.worker_id for s in self.members]
        if len(set(ids)) != len(ids):
            raise ConfigError("members", sorted(ids), "a worker holds two ranks")
        spare_ids = [w.worker_id for w in self.spares]
        if len(set(spare_ids)) != len(spare_ids):
            raise ConfigError("spares", sorted(spare_ids), "duplicate spare")
        both = set(ids) & set(spare_ids)
        if both:
            raise ConfigError("spares", sorted(both), "a spare is also a member")
        for slot in self.members:
            if slot.alive and slot.worker.node_id in self.dead_nodes:
                raise ConfigError(f"members[{slot.rank}].alive", True,
                                  f"node {slot.worker.node_id!r} is listed dead")

    def _check_reports(self) -> None:
        alive = {s.worker.worker_id: s.rank for s in self.members if s.alive}
        reported = [r.worker_id for r in self.reports]
        if len(set(reported)) != len(reported):
            raise ConfigError("reports", sorted(reported), "two reports from one worker")
        unknown = set(reported) - set(alive)
        if unknown:
            raise ConfigError("reports", sorted(unknown), "reports only come from live members")
        missing = set(alive) - set(reported)
        if missing:
            raise ConfigError("reports", sorted(missing), "every live member must report")
        chunks: dict[tuple[int, int], int] = {}
        for rep in self.reports:
            for fact in rep.replicas:
                if fact.owner >= self.world_size:
                    raise ConfigError(f"report[{rep.worker_id}].replicas.owner", fact.owner,
                                      f"outside world size {self.world_size}")
                if fact.owner == alive[rep.worker_id]:
                    raise ConfigError(f"report[{rep.worker_id}].replicas.owner", fact.owner,
                                      "a worker cannot mirror its own rank")
                key = (fact.owner, fact.version)
                if chunks.setdefault(key, fact.n_chunks) != fact.n_chunks:
                    raise ConfigError(f"report[{rep.worker_id}].replicas.n_chunks", fact.n_chunks,
                                      f"owner {fact.owner} v{fact.version} is {chunks[key]} chunks elsewhere")

    def _check_placement(self) -> None:
        for owner, holders in self.placement.items():
            if not 0 <= owner < self.world_size:
                raise ConfigError("placement", owner, "owner outside world")
            if owner in holders or len(set(holders)) != len(holders):
                raise ConfigError(f"placement[{owner}]", holders, "holders must be distinct non-owners")
            if any(not 0 <= h < self.world_size for h in holders):
                raise ConfigError(f"placement[{owner}]", holders, "holder outside world")

    def _check_node_local(self) -> None:
        seen: set[int] = set()
        for img in self.node_local:
            if not 0 <= img.rank < self.world_size:
                raise ConfigError("node_local.rank", img.rank, "outside world")
            if img.rank in seen:
                raise ConfigError("node_local.rank", img.rank, "two node-local images of one rank")
            seen.add(img.rank)
            slot = self.slot(img.rank)
            if slot.alive:
                raise ConfigError("node_local.rank", img.rank, "only a lost rank's image is node-local")
            if img.node_id != slot.worker.node_id:
                raise ConfigError("node_local.node_id", img.node_id,
                                  f"rank {img.rank} ran on node {slot.worker.node_id!r}")

    def _check_node_copies(self) -> None:
        seen: set[tuple[str, int, int, int]] = set()
        for c in self.node_copies:
            if not (0 <= c.owner < self.world_size and 0 <= c.holder < self.world_size):
                raise ConfigError("node_copy.owner", (c.owner, c.holder), "owner and holder must be in the world")
            if c.key in seen:
                raise ConfigError("node_copy", c.key, "listed twice")
            seen.add(c.key)

    # --- derived views (indexed once: the planner asks per rank, so a scan each was O(W^2)) -----
    @functools.cached_property
    def _slot_by_rank(self) -> dict[int, RankSlot]:
        return {s.rank: s for s in self.members}

    @functools.cached_property
    def _report_by_worker(self) -> dict[str, WorkerReport]:
        index: dict[str, WorkerReport] = {}
        for r in self.reports:
            index.setdefault(r.worker_id, r)  # the first, as a scan would find
        return index

    def slot(self, rank: int) -> RankSlot:
        s = self._slot_by_rank.get(rank)
        if s is None:
            raise ConfigError("rank", rank, "not a member")
        return s

    def report_of(self, worker_id: str) -> WorkerReport | None:
        return self._report_by_worker.get(worker_id)

    @property
    def lost_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(s.rank for s in self.members if not s.alive))
