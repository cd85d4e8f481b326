"""Last resort: every rank loads the newest complete disk snapshot.

Used only when the plan says no version is complete in surviving memory
(more failures in one placement group than it has replicas). The job's log and
ledger say exactly how many steps were lost.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ckptless.errors import UnrecoverableError
from ckptless.recovery.plan import DiskFallback
import shutil

from ckptless.snapshot import latest_complete, load_snapshot
from ckptless.snapshot.reader import scan_steps

if TYPE_CHECKING:
    from ckptless.job import Job

log = logging.getLogger(__name__)


def restore_from_disk(job: Job, decision: DiskFallback) -> int:
    directory = job.ctx.snapshot_dir
    if not directory:
        raise UnrecoverableError("the plan needs a disk snapshot but this worker has no --snapshot-dir")
    info = latest_complete(directory, job.ctx.job_id, job.world_size)
    if info is None or info.step != decision.snapshot_step:
        found = None if info is None else info.step
        raise UnrecoverableError(f"plan restores snapshot step {decision.snapshot_step}, newest complete here is {found}")
    step = load_snapshot(info, job.registry, job.rank)
    if job.rank == 0:
        # Snapshots newer than the one we resume from belong to a timeline that
        # is being replayed; their step directories will be written again.
        # Rank 0 removes them before the re-protection collective, so no rank
        # writes a new snapshot into a stale directory.
        for newer, path in scan_steps(directory, job.ctx.job_id):
            if newer > step:
                shutil.rmtree(path, ignore_errors=True)
    log.warning("rank %d: restored disk snapshot of step %d (%d steps lost: %s)",
                job.rank, step, decision.steps_lost, decision.reason)
    return step
