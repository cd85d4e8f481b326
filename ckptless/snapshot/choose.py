"""Which disk snapshot to restore: the newest one that is complete and whose bytes verify.

Why this exists: a planner that checked sizes only kept choosing a snapshot
with a same-size bit flip; every rank's load then failed its checksums and
the job retried the same snapshot until it gave up. The choice now reads the
content (every file against the CRC32C recorded at save time), never returns
a snapshot that fails, and says why each newer one was passed over, so the
caller can report what was lost and fall back instead of looping.

Rule (:func:`choose_snapshot`): walk the job's ``step_*`` directories newest
first; skip a directory without a marker (incomplete, possibly still being
written), a step the caller excludes (e.g. one whose load already failed),
and one that fails verification; return the first that passes. Everything
skipped is listed as ``(step, reason)``; older snapshots are not read.

Cost: with ``verify_content`` the chosen snapshot and every newer complete
one are read once in full (all ranks' files: sequential reads plus CRC32C at
several GB/s, so the disk's read bandwidth bounds it). Verdicts are cached in
this process (see :mod:`ckptless.snapshot.integrity` for the rule), so a
leader that chooses again during one job only ``stat``s the files. A worker
that is told which step to load should call ``verify_snapshot`` (structure
only) and ``load_snapshot``, which verifies that rank's own files, rather
than re-reading every rank's files itself.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

from ckptless.errors import SnapshotError
from ckptless.snapshot.reader import (
    FORMAT, MARKER, STEP_RE, SnapshotInfo, _bad, _check_rank_files, _read_marker, _read_part, scan_steps,
    verify_snapshot,
)

log = logging.getLogger(__name__)

Rejected = list[tuple[int, str]]


def choose_snapshot(directory: Path | str, job_id: str, world_size: int, *, verify_content: bool = True,
                    exclude: Collection[int] = ()) -> tuple[SnapshotInfo | None, Rejected]:
    """The snapshot to restore and the newer ones passed over, as ``(step, reason)``, newest first.

    Returns ``(None, rejected)`` when no snapshot qualifies. Never raises for
    a bad snapshot (only when the job's directory cannot be listed, as
    :class:`SnapshotError`). Safe to call from a process that holds no
    model: nothing is unpickled and no tensor is built.
    """
    rejected: Rejected = []
    excluded = set(exclude)
    for step, path in scan_steps(directory, job_id):
        if step in excluded:
            rejected.append((step, f"{path}: excluded by the caller"))
            continue
        if not (path / MARKER).exists():
            log.info("snapshot %s is incomplete (no %s): skipped", path, MARKER)
            rejected.append((step, f"{path}: incomplete (no {MARKER})"))
            continue
        try:
            info = verify_snapshot(path, job_id, world_size, verify_content=verify_content)
        except SnapshotError as exc:
            log.warning("snapshot skipped: %s", exc)
            rejected.append((step, str(exc)))
            continue
        except OSError as exc:  # e.g. a directory that vanished under us (retention of another writer)
            log.warning("snapshot skipped: %s: %s", path, exc)
            rejected.append((step, f"{path}: unreadable ({exc})"))
            continue
        return info, rejected
    return None, rejected


def latest_complete(directory: Path | str, job_id: str, world_size: int, *,
                    verify_content: bool = True) -> SnapshotInfo | None:
    """The snapshot :func:`choose_snapshot` picks, or None (the reasons are logged).

    Content is verified by default since format 2: a snapshot that only
    passes a size check is what made recoveries loop. Pass
    ``verify_content=False`` to check the marker, records and sizes only.
    """
    return choose_snapshot(directory, job_id, world_size, verify_content=verify_content)[0]


def list_complete(directory: Path | str, job_id: str, world_size: int, *,
                  verify_content: bool = True) -> list[SnapshotInfo]:
    """Every snapshot that verifies, newest first; others are skipped with a logged reason."""
    out = []
    for _, path in scan_steps(directory, job_id):
        if not (path / MARKER).exists():
            log.info("snapshot %s is incomplete (no %s): skipped", path, MARKER)
            continue
        try:
            out.append(verify_snapshot(path, job_id, world_size, verify_content=verify_content))
        except (SnapshotError, OSError) as exc:
            log.warning("snapshot skipped: %s", exc)
    return out


def verify_rank(path: Path, job_id: str, world_size: int, rank: int) -> SnapshotInfo:
    """Check one rank's part of a step directory: the marker, that rank's part record, the sizes and
    every byte of that rank's files (CRC32C, ``.metadata``'s SHA-256).

    What one rank of a whole-job restart checks before it votes on a step (``worker/plain_resume.py``):
    O(S) bytes for its own files, where ``verify_snapshot(verify_content=True)`` reads every rank's,
    O(W x S). Format-1 snapshots are refused here as by ``choose_snapshot`` (no per-file checksums).
    Raises :class:`SnapshotError` naming the file and field, as ``verify_snapshot`` does.
    """
    m = STEP_RE.match(path.name)
    if m is None:
        raise _bad(path, "<dirname>", path.name, "not a step_NNNNNNNN directory")
    info = _read_marker(path, job_id, world_size, int(m.group(1)))
    if info.format < 2:
        raise _bad(path / MARKER, "format", info.format, f"expected {FORMAT}: format-1 snapshots have no per-file "
                   "checksums, so their content cannot be verified before loading")
    if type(rank) is not int or not 0 <= rank < world_size:
        raise SnapshotError(f"{path}: rank {rank!r} not in [0, {world_size})")
    rec = _read_part(info, rank, path / MARKER)
    _check_rank_files(info, rank, rec, content=False)
    _check_rank_files(info, rank, rec, content=True)
    return info
