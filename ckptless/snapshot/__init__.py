"""ckptless.snapshot: periodic asynchronous disk snapshots in DCP format (the last resort).

Public API::

    cfg = SnapshotConfig(directory="/shared/snaps", job_id="job", every=500, keep=2)
    w = SnapshotWriter(cfg, registry, rank, world_size)
    w.maybe_snapshot(step)          # after each step; copies, then writes in the background
    w.close()

    # planner (any process): newest complete snapshot whose bytes verify
    info, rejected = choose_snapshot("/shared/snaps", "job", world_size)   # rejected: [(step, reason)]
    if info is not None:
        step = load_snapshot(info, registry, rank)   # re-verifies this rank's files; exact restore

    # a whole-job start (the launcher): refuse a world that does not match the snapshots, or set them aside
    mismatch = check_world("/shared/snaps", "job", world_size)   # WorldMismatch | None
    moved = set_aside("/shared/snaps", "job")                      # --fresh-start: renamed, never deleted

See docs/snapshots.md for the on-disk layout and the completion protocol.
"""

from ckptless.snapshot.choose import choose_snapshot, latest_complete, list_complete, verify_rank
from ckptless.snapshot.config import SnapshotConfig
from ckptless.snapshot.integrity import FileSum, SnapshotIntegrityError
from ckptless.snapshot.reader import (
    FORMAT, MARKER, PartRecord, SnapshotInfo, forget_verified, load_snapshot, read_marker, scan_steps, step_dir,
    verify_snapshot,
)
from ckptless.snapshot.restart import (
    SET_ASIDE, StoredSnapshot, WorldMismatch, check_world, foreign_owner, set_aside, stored_snapshots)
from ckptless.snapshot.retention import SnapshotEntry, plan_retention
from ckptless.snapshot.writer import SnapshotWriter

__all__ = [
    "FORMAT", "MARKER", "SET_ASIDE", "FileSum", "PartRecord", "SnapshotConfig", "SnapshotEntry", "SnapshotInfo",
    "SnapshotIntegrityError", "SnapshotWriter", "StoredSnapshot", "WorldMismatch", "check_world",
    "choose_snapshot", "foreign_owner", "forget_verified", "latest_complete", "list_complete", "load_snapshot", "plan_retention",
    "read_marker", "scan_steps", "set_aside", "step_dir", "stored_snapshots", "verify_rank", "verify_snapshot",
]
