"""Worker-side execution of a recovery decision: transfer, roll back, or load from disk.

Why it is separate from the job loop: the loop only notices a failure and
asks for the next generation; what to do with the decision (rebuild a lost
image from stripes, restore our own image of the resume version, or load the
newest complete disk snapshot) is derived from the plan alone.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import torch.distributed as dist

from ckptless.errors import CkptlessError, MirrorError, RecoveryError, TransportError
from ckptless.goodput.ledger import EventKind
from ckptless.mirror.store import PeerStore, StoredImage
from ckptless.recovery.facts import ReplicaFact, WorkerReport
from ckptless.recovery.plan import Decision, DiskFallback, RecoveryPlan
from ckptless.recovery.transfer import execute_transfers
from ckptless.recovery.wire import Membership
from ckptless.state.capture import StateImage, restore

if TYPE_CHECKING:
    from ckptless.job import Job

log = logging.getLogger(__name__)


class PeerFailure(CkptlessError):
    """Another rank of this generation failed (seen via the coordinator, not a collective)."""


# What a broken collective looks like from Python: Gloo raises plain RuntimeError
# (or torch's DistError family); our own layers raise the typed errors.
RECOVERABLE: tuple[type[BaseException], ...] = (RuntimeError, MirrorError, TransportError, PeerFailure, dist.DistError)
_GLOO_FAILURE = re.compile(
    r"(Connection (closed|reset|refused)|Broken pipe|Socket|Timed out|timed out|gloo|Gloo|NCCL|"
    r"process group|ProcessGroup|Connection timed out|peer)",
)


def is_recoverable(exc: BaseException) -> bool:
    """True for failures caused by a peer or the transport, not by a bug in the step."""
    if isinstance(exc, (MirrorError, TransportError, PeerFailure, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and bool(_GLOO_FAILURE.search(str(exc)))


def build_report(worker_id: str, own: list[StoredImage], store: PeerStore | None, committed: int | None) -> WorkerReport:
    """The facts this worker contributes to planning: what it holds, nothing more."""
    local = {img.manifest.version for img in own}
    replicas: list[ReplicaFact] = []
    if store is not None:
        for owner in store.owners():
            for version in store.versions(owner):
                img = store.get(owner, version)
                if img is not None:
                    replicas.append(ReplicaFact(owner, version, len(img.manifest.chunk_checksums)))
    return WorkerReport(
        worker_id=worker_id,
        newest_captured=max(local) if local else None,
        committed=committed,
        local_versions=frozenset(local),
        replicas=tuple(replicas),
    )


def _own_image(own: list[StoredImage], version: int) -> StoredImage:
    hits = [img for img in own if img.manifest.version == version]
    if not hits:
        have = sorted({img.manifest.version for img in own})
        raise RecoveryError(f"plan resumes at v{version} from local memory, but this rank holds only {have}")
    return max(hits, key=lambda img: img.manifest.generation)


def apply_decision(job: Job, membership: Membership, decision: Decision) -> int:
    """Bring this rank's protected state to the decision's resume point; returns the step to run next."""
    if isinstance(decision, RecoveryPlan):
        received = execute_transfers(decision, membership, job.worker_id, job.peer_store, job.ctx.collective_timeout_s)
        job.ledger.emit(EventKind.TRANSFER_DONE, generation=job.generation,
                        bytes=0 if received is None else received.manifest.total_bytes)
        resume = decision.resume_version
        if received is not None:
            restore(job.registry, StateImage(received.manifest, received.buffer))
        else:
            img = _own_image(job._own_images, resume)
            restore(job.registry, StateImage(img.manifest, img.buffer))
        if job.peer_store is not None:
            job.peer_store.discard_newer(resume)
        job.ledger.emit(EventKind.ROLLBACK_DONE, step=resume, generation=job.generation)
        return resume
    if isinstance(decision, DiskFallback):
        from ckptless.recovery.disk import restore_from_disk

        step = restore_from_disk(job, decision)
        job.ledger.emit(EventKind.DISK_RESTORE, step=step, generation=job.generation,
                        steps_lost=decision.steps_lost, reason=decision.reason[:200])
        if job.peer_store is not None:
            job.peer_store.discard_newer(step)
        return step
    raise RecoveryError(f"cannot execute a {type(decision).__name__} decision")
