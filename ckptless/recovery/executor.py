"""Worker-side execution of a recovery decision: transfer, roll back, load from disk, or start fresh.

Why it takes explicit inputs and returns an outcome: what a rank must do to
reach the decision's resume point is derived from the plan alone (plus what
the rank holds), so it is testable without a job loop, and the job loop does
not have to expose its internals. Errors keep their type: a transport
failure is a fault (the generation failed again: report and wait), a disk
snapshot that does not load is named so the coordinator never picks it again.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptless import chaos_hooks
from ckptless.errors import (IntegrityError, ManifestError, NodeCopyError, RecoveryError, SnapshotError,
                             UnrecoverableError)
from ckptless.mirror import ownimage
from ckptless.mirror import PeerStore, StoredImage
from ckptless.recovery.facts import ReplicaFact, WorkerReport
from ckptless.state import manifest_layout_key
from ckptless.recovery.decision import Decision, DiskFallback, LocalRestore, RecoveryPlan
from ckptless.recovery.transfer import Received, execute_transfers
from ckptless.recovery.wire import Membership
from ckptless.state import StateImage, restore
from ckptless.state import StateRegistry
from ckptless.state import first_held_chunk, region_of

log = logging.getLogger(__name__)


class SnapshotLoadFailed(RecoveryError):
    """This rank could not load the disk snapshot the plan named; the coordinator excludes that step."""

    def __init__(self, step: int, reason: str) -> None:
        self.step = step
        super().__init__(f"disk snapshot step {step} could not be loaded: {reason}")


@dataclass(frozen=True)
class RestoreInputs:
    """What one rank brings to a recovery decision."""

    membership: Membership
    worker_id: str
    registry: StateRegistry
    own_images: list[StoredImage]
    peer_store: PeerStore | None
    timeout_s: float
    job_id: str
    snapshot_dir: str | None = None
    # How an image is loaded into the objects (the job wraps it so that state replaying a
    # collective, e.g. a DDP reducer's bucket rebuild, stays local); default: plain restore.
    restore_fn: Callable[[StateRegistry, StateImage, bool], None] | None = None
    # The node-local tier: this node's shm dir and the node id its files are named by.
    shm_dir: str | None = None
    node_id: str | None = None
    # A buffer (already faulted in) to receive this rank's image into, when it is a receiver.
    into: torch.Tensor | None = None
    # Own images live in this process's anonymous memory (captured and checksummed here): as trusted
    # as the live state, so a local rollback does not re-read their checksums. False: shm files.
    own_images_trusted: bool = False
    # The own image this rank already rolled back to while its generation formed (restore_early).
    restored_early: StateImage | None = None
    # The plan's transfers already ran, on the generation's mirror group formed ahead of the others
    # (worker/actions.py): what this rank received there (None: it received nothing).
    transfers_done: bool = False
    received_early: Received | None = None
    # The newest version this process trained to (None: it trained nothing yet, a replacement).
    trained: int | None = None
    # Where this node's peer stores keep their replicas (``--shm-dir``): the copies a plan has this
    # worker adopt (R11) are read from there. None: no node-local tier.
    replica_dir: str | None = None

    @property
    def rank(self) -> int:
        r = self.membership.rank_of(self.worker_id)
        if r is None:
            raise RecoveryError(f"worker {self.worker_id} has no rank in generation {self.membership.generation}")
        return r


@dataclass(frozen=True)
class RestoreOutcome:
    resume_step: int
    source: str  # "local" (own image), "peers" (striped transfer), "node-local" (own image the
    # predecessor left in this node's shm dir), "disk", "initial" (fresh state)
    bytes_received: int = 0
    steps_lost: int = 0
    # The image the state was loaded from, byte for byte (anonymous memory): the caller can mirror
    # it as the resume version instead of capturing the state again. None: capture (disk, initial,
    # node-local files).
    image: StateImage | None = None
    bytes_from_replicas: int = 0  # of bytes_received: a replicated prefix sent by live replicas


#: How old a replica's checksum verdict may be and still be reported without re-reading it.
#: Every replica is verified when it lands (and its shm file's stat is compared on each check), so
#: a fresh verdict only misses rot in anonymous memory within this window. The receiver checks every
#: stripe again on arrival; after a failed restore the next report re-reads everything (``recheck``).
REPORT_VERDICT_MAX_AGE_S = 60.0


def build_report(worker_id: str, own: list[StoredImage], store: PeerStore | None, committed: int | None,
                 recheck: bool = False) -> WorkerReport:
    """The facts this worker contributes to planning: what it holds, each (owner, version) once.

    ``recheck``: re-read every replica (the last restore failed, maybe on a replica that rotted);
    otherwise verdicts younger than :data:`REPORT_VERDICT_MAX_AGE_S` are trusted. Why not always
    re-read: K x S of checksums on every survivor, on 2 cores about 0.1-0.2 s at 256 MiB, sat
    between the failure and the plan of every recovery.
    """
    local = {img.manifest.version for img in own}
    if committed is not None and committed not in local:
        committed = None  # we no longer hold it: do not claim it
    if committed is not None:
        local = {v for v in local if v >= committed}
    replicas: dict[tuple[int, int], ReplicaFact] = {}
    if store is not None:
        at_rest = store.check_at_rest(max_age_s=0 if recheck else REPORT_VERDICT_MAX_AGE_S)
        for owner, version, bad in at_rest.corrupt:
            log.warning("replica of rank %d v%d is corrupt at rest (chunks %s): dropped", owner, version, bad[:8])
            store.drop(owner, version)
        for owner, version, n_chunks in at_rest.verified:
            held = store.get(owner, version)
            first = 0 if held is None else first_held_chunk(held.manifest)
            region = None if held is None or first == 0 else region_of(held.manifest)
            replicas.setdefault((owner, version), ReplicaFact(owner, version, n_chunks, store.layout_of(owner, version),
                                                              first, None if region is None else region.ranks))
    return WorkerReport(
        worker_id=worker_id,
        newest_captured=max(local) if local else None,
        committed=committed,
        local_versions=frozenset(local),
        replicas=tuple(replicas[k] for k in sorted(replicas)),
        own_layouts=tuple(sorted({(img.manifest.version, _own_layout(img)) for img in own
                                  if img.manifest.version in local})),
    )


_OWN_LAYOUTS: dict[int, tuple[object, str]] = {}  # id(manifest) -> (manifest, key): a rank's few own images


def _own_layout(img: StoredImage) -> str:
    """The layout key of one of this rank's own images, computed once per image (a few ms at most)."""
    hit = _OWN_LAYOUTS.get(id(img.manifest))
    if hit is not None and hit[0] is img.manifest:
        return hit[1]
    key = manifest_layout_key(img.manifest)
    if len(_OWN_LAYOUTS) >= 8:
        _OWN_LAYOUTS.clear()
    _OWN_LAYOUTS[id(img.manifest)] = (img.manifest, key)
    return key


def _own_image(own: list[StoredImage], version: int) -> StoredImage:
    hits = [img for img in own if img.manifest.version == version]
    if not hits:
        have = sorted({img.manifest.version for img in own})
        raise RecoveryError(f"plan resumes at v{version} from local memory, but this rank holds only {have}")
    return max(hits, key=lambda img: img.manifest.generation)


def _restore(inputs: RestoreInputs, image: StateImage, verify: bool = True) -> None:
    """Load ``image``; ``verify=False`` only for bytes whose every chunk was just checked on arrival."""
    if inputs.restore_fn is not None:
        inputs.restore_fn(inputs.registry, image, verify)
    else:
        restore(inputs.registry, image, verify=verify)


def apply_decision(decision: Decision, inputs: RestoreInputs) -> RestoreOutcome:
    """Bring this rank's protected state to the decision's resume point (collective for transfers)."""
    if isinstance(decision, RecoveryPlan):
        return _from_memory(decision, inputs)
    if isinstance(decision, DiskFallback):
        return _from_disk(decision, inputs)
    raise RecoveryError(f"cannot execute a {type(decision).__name__} decision")


def rolls_back_locally(plan: RecoveryPlan, inputs: RestoreInputs) -> bool:
    """True when this rank reaches the resume point from its own image in its memory: it receives
    nothing, restores nothing node-local, and is not starting from its initial state (R0)."""
    me = inputs.worker_id
    return (not any(t.receiver == me for t in plan.transfers)
            and not any(x.worker_id == me for x in plan.node_local)
            and inputs.rank not in plan.initial_ranks)


def restore_early(decision: Decision | None, inputs: RestoreInputs) -> StateImage | None:
    """Roll back to the plan's resume version from this rank's own image before the groups form.

    Why: the rollback needs no peer, and the formation waits for every rank
    anyway (a respawn runs the user's setup first), so the copy of S runs
    there instead of after it. :func:`apply_decision` then skips it
    (``RestoreInputs.restored_early``). Returns None when this rank does not
    roll back locally. If the formation fails, the state is simply restored
    again for the next plan: the own images are kept until a restore succeeds.
    """
    if not isinstance(decision, RecoveryPlan) or not rolls_back_locally(decision, inputs):
        return None
    img = _own_image(inputs.own_images, decision.resume_version)
    image = StateImage(img.manifest, img.buffer)
    _restore(inputs, image, verify=not inputs.own_images_trusted)
    return image


def _from_memory(plan: RecoveryPlan, inputs: RestoreInputs) -> RestoreOutcome:
    version = plan.resume_version
    rank = inputs.rank
    local = next((x for x in plan.node_local if x.worker_id == inputs.worker_id), None)
    if local is not None:  # before the collective transfers: a bad copy fails this generation at once
        _restore_node_local(local, inputs)
    if not inputs.transfers_done:  # (when they ran ahead, the adoptions ran before them: worker/ahead.py)
        adopt_copies(plan, inputs.worker_id, inputs.peer_store, inputs.replica_dir, inputs.job_id, inputs.node_id,
                     for_transfers=True)
    if inputs.transfers_done:
        received = inputs.received_early
    else:
        received = execute_transfers(plan, inputs.membership, inputs.worker_id, inputs.peer_store,
                                     inputs.timeout_s, into=inputs.into, own=inputs.own_images)
    image: StateImage | None = None
    if local is not None:
        source, nbytes = "node-local", 0
    elif received is not None:
        image = StateImage(received.manifest, received.buffer)
        _restore(inputs, image, verify=False)  # every stripe was checked against its chunk CRCs on arrival
        source, nbytes = "peers", received.manifest.total_bytes
    elif rank in plan.initial_ranks:
        source, nbytes = "initial", 0  # R0: the state this process built is the initial state
    elif inputs.restored_early is not None and inputs.restored_early.manifest.version == version:
        image, source, nbytes = inputs.restored_early, "local", 0
    else:
        img = _own_image(inputs.own_images, version)
        image = StateImage(img.manifest, img.buffer)
        _restore(inputs, image, verify=not inputs.own_images_trusted)
        source, nbytes = "local", 0
    if inputs.peer_store is not None:
        inputs.peer_store.discard_newer(version)
    _discard_newer_own(inputs, version)
    replicas = 0 if received is None else received.from_replicas
    return RestoreOutcome(version, source, nbytes, plan.steps_lost, image, replicas)


def _restore_node_local(local: LocalRestore, inputs: RestoreInputs) -> None:
    """R9: load the own image the predecessor left on this node, re-verifying every chunk first.

    Raises :class:`ckptless.mirror.ownimage.NodeLocalImageError` (an
    ``IntegrityError``) when it is gone, differs from what the agent
    reported, or a checksum fails: the worker reports a failed restore, and
    since it is then a live replacement (not a lost rank with a node-local
    image) the re-plan pulls its image from peers.
    """
    if local.rank != inputs.rank:
        raise RecoveryError(f"the plan restores rank {local.rank} from node-local memory into rank {inputs.rank}")
    if not inputs.shm_dir:
        raise ownimage.NodeLocalImageError("the plan restores from node-local memory, but this worker has no shm dir")
    chaos_hooks.pause_point(f"restore:node-local:r{local.rank}", rank=local.rank)
    manifest, buf = ownimage.open_verified(inputs.shm_dir, inputs.job_id, inputs.node_id, local.rank,
                                           local.version, local.n_chunks, local.generation)
    # No other process writes the file (its writer is dead, this process writes it only after its
    # own first commit): what was verified is what is restored.
    _restore(inputs, StateImage(manifest, buf))
    log.info("rank %d: restored v%d from node-local memory (%d bytes, no transfer)",
             local.rank, local.version, manifest.total_bytes)


def adopt_copies(plan: RecoveryPlan, worker_id: str, store: PeerStore | None, shm_dir: str | None, job_id: str,
                 node_id: str | None, for_transfers: bool = False) -> int:
    """R11: take the node-local copies the plan names for this worker into its peer store, each re-verified
    (every chunk), before it serves stripes from them or hosts their rank. Returns how many it took.
    ``for_transfers``: only those of images the plan transfers (the rest are for hosting, taken when the
    worker starts hosting: a respawn opens its store only then).

    Idempotent (a copy already held is skipped): the transfers run ahead for survivors, and a hosting
    survivor may take one there and look again when it starts hosting. Raises ``IntegrityError`` (the
    restore fails and is re-planned) when a copy is gone, differs from the plan, or no longer checks.
    """
    from ckptless.mirror import open_copy
    from ckptless.state import held_from

    sent = {t.owner for t in plan.transfers}
    mine = [a for a in plan.adoptions if a.worker_id == worker_id and (not for_transfers or a.owner in sent)]
    if not mine:
        return 0
    if store is None or not shm_dir:
        raise IntegrityError(f"the plan has {worker_id} adopt node-local copies, but it has no node-local tier")
    taken = 0
    for a in mine:
        held = store.get(a.owner, a.version)
        if held is not None and held.manifest.generation == a.generation:
            continue
        try:
            if a.holder == a.owner:  # that rank's own image: the whole image, kept from held_from() on
                m, buf = ownimage.open_verified(shm_dir, job_id, node_id, a.owner, a.version, a.n_chunks,
                                                a.generation)
                part = buf[held_from(m): m.total_bytes]
            else:
                m, part = open_copy(shm_dir, job_id, node_id, a.holder, a.owner, a.version, a.generation, a.n_chunks)
            store.take_copy(m, part)
        except (IntegrityError, ManifestError, OSError, RuntimeError) as exc:
            raise NodeCopyError((a.node_id, a.holder, a.owner, a.version),
                                f"rank {a.owner}'s image of v{a.version} in rank {a.holder}'s files on {a.node_id}: "
                                f"{exc}") from exc
        taken += 1
        log.warning("%s: took rank %d's image of v%d from this node's memory (left by rank %d's worker, %d bytes)",
                    worker_id, a.owner, a.version, a.holder, m.total_bytes)
    return taken


def _discard_newer_own(inputs: RestoreInputs, version: int) -> None:
    """Own images newer than the resume point belong to a timeline being replayed: never offer them."""
    if inputs.shm_dir:
        try:
            ownimage.discard_newer(inputs.shm_dir, inputs.job_id, inputs.node_id, inputs.rank, version)
        except OSError as exc:
            log.warning("rank %d: could not discard newer node-local images: %s", inputs.rank, exc)


def _from_disk(decision: DiskFallback, inputs: RestoreInputs) -> RestoreOutcome:
    from ckptless.snapshot import load_snapshot, step_dir, verify_snapshot
    from ckptless.snapshot import scan_steps
    from ckptless.snapshot import foreign_owner

    directory = inputs.snapshot_dir
    step = decision.snapshot_step
    if not directory:
        raise UnrecoverableError("the plan needs a disk snapshot but this worker has no --snapshot-dir")
    world = inputs.membership.world_size
    try:
        info = verify_snapshot(step_dir(directory, inputs.job_id, step), inputs.job_id, world)
        loaded = load_snapshot(info, inputs.registry, inputs.rank)
    except SnapshotError as exc:
        raise SnapshotLoadFailed(step, str(exc)) from exc
    if inputs.rank == 0:
        # Snapshots newer than the one we resume from belong to a timeline being replayed; their
        # step directories will be written again. Rank 0 removes them before training resumes.
        for newer, path in scan_steps(directory, inputs.job_id):
            if newer > loaded and foreign_owner(Path(path), inputs.job_id, world) is None:
                shutil.rmtree(Path(path), ignore_errors=True)  # never another world's complete snapshot
    if inputs.peer_store is not None:
        inputs.peer_store.discard_newer(loaded)
    _discard_newer_own(inputs, loaded)
    if inputs.membership.generation == 0:  # a whole-job restart: the worker logs the previous run's loss
        log.info("rank %d: restored disk snapshot of step %d (%s)", inputs.rank, loaded, decision.reason)
        return RestoreOutcome(loaded, "disk", 0, decision.steps_lost)
    lost, line = disk_restore_line(inputs.rank, loaded, inputs.trained, decision.steps_lost, decision.reason)
    log.warning("%s", line)
    return RestoreOutcome(loaded, "disk", 0, lost)


def disk_restore_line(rank: int, loaded: int, trained: int | None, planned: int, reason: str) -> tuple[int, str]:
    """The steps a fall-back to disk costs this rank, and the line that says so.

    The plan counts from the newest version captured in memory, which lags the steps trained where
    versions are not captured every step (a job with fewer ranks is not mirrored; ``--mirror-every``
    > 1): issue 35 saw "2 steps lost" when 9 were trained again. A rank that trained counts its own
    steps past the snapshot; a replacement, which trained none, says what the plan saw, as a floor."""
    if trained is None:
        return planned, (f"rank {rank}: restored disk snapshot of step {loaded} (at least {planned} steps lost: "
                         f"the newest version captured in memory was {loaded + planned}; {reason})")
    lost = max(0, trained - loaded)
    return lost, (f"rank {rank}: restored disk snapshot of step {loaded} ({lost} steps lost: this rank had "
                  f"trained to step {trained}; {reason})")
