"""Which snapshot directories to delete (pure: no file system here).

Why pure: the rule decides what survives a disaster, so it is property-tested
on its own (``tests/e2e/test_snapshot.py``) and the I/O around it stays trivial.

Rules, for one job's ``step_*`` directories, as seen by a writer of
``world_size`` ranks:

0. A complete snapshot of *another* world size (or whose marker cannot be
   read, ``world_size`` None) is another run's: it is never deleted and
   does not count below. Why (issue 17): a job relaunched with another
   world size trained from step 0 and its retention deleted the previous
   run's complete snapshots, which it had not superseded. Without
   ``world_size`` (None) every complete snapshot counts as the writer's
   own, as before.
1. The ``keep`` newest *own* complete snapshots survive; older own complete
   ones go. The newest own complete one is therefore never deleted
   (``keep >= 1``).
2. An *incomplete* directory (no completion marker) older than the newest
   own complete snapshot is a failed or abandoned write: it goes.
3. An incomplete directory newer than the newest own complete snapshot may
   still be in flight (other ranks writing, rank 0 waiting): it survives
   until a newer snapshot completes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckptless.errors import ConfigError


@dataclass(frozen=True)
class SnapshotEntry:
    """One ``step_*`` directory as seen on disk: its step, whether it has a marker, and the world size
    its marker records (None: not read, or unreadable)."""

    step: int
    complete: bool
    world_size: int | None = None


def plan_retention(entries: Iterable[SnapshotEntry], keep: int, world_size: int | None = None) -> list[int]:
    """Steps whose directories should be deleted, ascending.

    ``world_size``: the writer's world; complete entries of any other (or
    unknown) world are never returned. Raises :class:`ConfigError` when
    ``keep < 1`` or a step appears twice (two directories cannot have the
    same step; seeing it means the caller mixed jobs).
    """
    if type(keep) is not int or keep < 1:
        raise ConfigError("keep", keep, "must be an int >= 1")
    items = list(entries)
    steps = [e.step for e in items]
    if len(set(steps)) != len(steps):
        dup = sorted(s for s in set(steps) if steps.count(s) > 1)[0]
        raise ConfigError("step", dup, "appears in more than one snapshot entry")
    own = sorted((e.step for e in items if e.complete and (world_size is None or e.world_size == world_size)),
                 reverse=True)
    if not own:
        return []  # nothing of ours is safe to fall back to: delete nothing, not even partial writes
    newest = own[0]
    doomed = set(own[keep:])
    doomed.update(e.step for e in items if not e.complete and e.step < newest)
    return sorted(doomed)
