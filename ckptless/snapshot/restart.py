"""What a starting job, and a writer, may do with snapshots that another run left in the directory.

Why this exists (issue 17): a job relaunched with the same id but another
world size found only snapshots it could not load (``choose_snapshot``
rejects another world's snapshot, rightly), logged warnings, trained from
step 0, and its retention then deleted the previous run's complete
snapshots - the user's last-resort copy - because retention counted every
complete snapshot as its own. Three rules close that:

1. **A start must match the snapshots' world** (:func:`world_mismatch`).
   The newest complete snapshot whose marker reads says which world the
   job's timeline belongs to; a start with another world size is refused
   by the launcher (one :class:`~ckptless.errors.ConfigError`) before any
   worker runs, unless it asks for a fresh start.
2. **A fresh start sets the old snapshots aside, unchanged**
   (:func:`set_aside`): the job's directory is renamed, in one atomic
   ``rename``, to a sibling ``<job_id>.set-aside-<UTC time>``. Why not keep
   them in place: the new run would write the same ``step_N`` names into
   the old snapshots' directories, and a later plain restart would see two
   timelines in one directory and could not tell which is newest. Nothing
   under the set-aside directory is ever read, written or deleted by
   ckptless; renaming it back restores the old timeline.
3. **A writer never deletes or overwrites another world's complete
   snapshot** (:func:`foreign_owner`, ``plan_retention(world_size=...)``):
   a defence in depth for directories that already mix worlds (written
   before this rule, or by a start that bypassed the launcher). Only the
   run's own world's snapshots count for retention.

Only markers are read here (small JSON, self-digested): deciding costs one
listing and one small read per complete snapshot, never the data files.
Nothing is unpickled.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptless.errors import SnapshotError
from ckptless.snapshot.config import check_job_id
from ckptless.snapshot.reader import MARKER, read_marker, scan_steps

log = logging.getLogger(__name__)

SET_ASIDE = ".set-aside-"
"""Infix of a set-aside job directory's name: ``<job_id>.set-aside-<YYYYmmddTHHMMSSZ>[-<n>]``."""


@dataclass(frozen=True)
class StoredSnapshot:
    """A complete (marked) step directory and the world size its marker records.

    ``world_size`` is None when the marker cannot be read (corrupt, another
    job's, or a format this version does not read): such a snapshot says
    nothing about the timeline and is never deleted by a writer.
    """

    step: int
    world_size: int | None


@dataclass(frozen=True)
class WorldMismatch:
    """Why a start of ``job_world`` ranks cannot resume from the snapshots in ``job_dir``."""

    job_dir: Path
    world_size: int            # the world of the newest complete snapshot
    steps: tuple[int, ...]     # the complete snapshots of that world, newest first
    job_world: int


def marker_world(path: Path, job_id: str) -> int | None:
    """The world size the marker of step directory ``path`` records; None when it cannot be read."""
    try:
        return read_marker(path, job_id).world_size
    except (SnapshotError, OSError) as exc:
        log.info("snapshot marker of %s unreadable: %s", path, exc)
        return None


def stored_snapshots(directory: Path | str, job_id: str) -> list[StoredSnapshot]:
    """The job's complete snapshots, newest first, with the world their markers record."""
    return [StoredSnapshot(step, marker_world(path, job_id))
            for step, path in scan_steps(directory, job_id) if (path / MARKER).exists()]


def world_mismatch(stored: Sequence[StoredSnapshot], world_size: int) -> tuple[int, tuple[int, ...]] | None:
    """Pure: ``(their world, their steps newest first)`` when a start of ``world_size`` ranks must be
    refused, else None.

    The newest complete snapshot with a readable marker decides: it is where
    the job's timeline stands. Older snapshots of another world (left by an
    earlier run in a mixed directory) do not block a start whose world
    matches the newest one, and unreadable markers decide nothing (the
    snapshot chooser reports them). No complete snapshot: nothing to refuse.
    """
    known = [s for s in sorted(stored, key=lambda s: s.step, reverse=True) if s.world_size is not None]
    if not known or known[0].world_size == world_size:
        return None
    theirs = known[0].world_size
    assert theirs is not None
    return theirs, tuple(s.step for s in known if s.world_size == theirs)


def check_world(directory: Path | str, job_id: str, world_size: int) -> WorldMismatch | None:
    """The mismatch between a start of ``world_size`` ranks and the job's complete snapshots, if any."""
    found = world_mismatch(stored_snapshots(directory, job_id), world_size)
    if found is None:
        return None
    return WorldMismatch(Path(directory) / job_id, found[0], found[1], world_size)


def foreign_owner(path: Path, job_id: str, world_size: int) -> str | None:
    """Who else owns step directory ``path``: None when it has no marker or its marker is of
    ``world_size``; otherwise a phrase naming the other world (or the unreadable marker).

    A writer of ``world_size`` ranks must not write into, mark or delete a
    directory this names: it is another run's complete snapshot.
    """
    if not (path / MARKER).exists():
        return None
    try:
        theirs = read_marker(path, job_id).world_size
    except (SnapshotError, OSError) as exc:
        return f"a complete snapshot whose marker this run cannot read ({exc})"
    return None if theirs == world_size else f"a complete snapshot of world size {theirs}"


def set_aside_name(job_id: str, when: float, attempt: int = 0) -> str:
    """Pure: the name a job directory is set aside under (``attempt`` > 0 when that name is taken)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
    return f"{check_job_id(job_id)}{SET_ASIDE}{stamp}" + (f"-{attempt}" if attempt else "")


def set_aside(directory: Path | str, job_id: str, when: float | None = None) -> Path | None:
    """Rename the job's snapshot directory, unchanged, to a free set-aside name; return the new path.

    Returns None (and touches nothing) when the job has no directory or an
    empty one: harmless on a fresh directory. The new name is claimed with
    an exclusive ``mkdir`` first, so an existing directory is never
    replaced; the ``rename`` itself is atomic (one file system), so the old
    snapshots are either all in the job directory or all set aside.
    Raises :class:`SnapshotError` when the directory cannot be renamed.
    """
    root = Path(directory)
    jdir = root / check_job_id(job_id)
    try:
        if not any(jdir.iterdir()):
            return None
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SnapshotError(f"{jdir}: cannot list snapshots ({exc})") from exc
    when = time.time() if when is None else when
    for attempt in range(1000):
        target = root / set_aside_name(job_id, when, attempt)
        try:
            target.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise SnapshotError(f"{target}: cannot create the set-aside directory ({exc})") from exc
        try:
            os.replace(jdir, target)  # replaces only the empty directory claimed just above
        except OSError as exc:
            try:
                target.rmdir()
            except OSError:
                pass
            why = "not empty" if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) else str(exc)
            raise SnapshotError(f"{jdir}: cannot set the old snapshots aside as {target} ({why})") from exc
        _fsync_dir(root)
        log.warning("snapshots of job %s set aside, unchanged, in %s", job_id, target)
        return target
    raise SnapshotError(f"{root}: no free set-aside name for job {job_id!r}")


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: some file systems refuse a directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
