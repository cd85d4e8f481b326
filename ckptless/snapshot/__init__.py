"""ckptless.snapshot: periodic asynchronous disk snapshots in DCP format (the last resort).

Public API::

    cfg = SnapshotConfig(directory="/shared/snaps", job_id="job", every=500, keep=2)
    w = SnapshotWriter(cfg, registry, rank, world_size)
    w.maybe_snapshot(step)          # after each step; copies, then writes in the background
    w.close()

    info = latest_complete("/shared/snaps", "job", world_size)   # SnapshotInfo | None
    if info is not None:
        step = load_snapshot(info, registry, rank)               # exact restore

See docs/snapshots.md for the on-disk layout and the completion protocol.
"""

from ckptless.snapshot.config import SnapshotConfig
from ckptless.snapshot.reader import (
    MARKER, PartRecord, SnapshotInfo, latest_complete, list_complete, load_snapshot, step_dir, verify_snapshot,
)
from ckptless.snapshot.retention import SnapshotEntry, plan_retention
from ckptless.snapshot.writer import SnapshotWriter

__all__ = [
    "MARKER", "PartRecord", "SnapshotConfig", "SnapshotEntry", "SnapshotInfo", "SnapshotWriter",
    "latest_complete", "list_complete", "load_snapshot", "plan_retention", "step_dir", "verify_snapshot",
]
