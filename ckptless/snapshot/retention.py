"""Which snapshot directories to delete (pure: no file system here).

Why pure: the rule decides what survives a disaster, so it is property-tested
on its own (``tests/test_snapshot.py``) and the I/O around it stays trivial.

Rules, for one job's ``step_*`` directories:

1. The ``keep`` newest *complete* snapshots survive; older complete ones go.
   The newest complete one is therefore never deleted (``keep >= 1``).
2. An *incomplete* directory (no completion marker) older than the newest
   complete snapshot is a failed or abandoned write: it goes.
3. An incomplete directory newer than the newest complete snapshot may still
   be in flight (other ranks writing, rank 0 waiting): it survives until a
   newer snapshot completes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckptless.errors import ConfigError


@dataclass(frozen=True)
class SnapshotEntry:
    """One ``step_*`` directory as seen on disk: its step and whether it has a marker."""

    step: int
    complete: bool


def plan_retention(entries: Iterable[SnapshotEntry], keep: int) -> list[int]:
    """Steps whose directories should be deleted, ascending.

    Raises :class:`ConfigError` when ``keep < 1`` or a step appears twice
    (two directories cannot have the same step; seeing it means the caller
    mixed jobs).
    """
    if type(keep) is not int or keep < 1:
        raise ConfigError("keep", keep, "must be an int >= 1")
    items = list(entries)
    steps = [e.step for e in items]
    if len(set(steps)) != len(steps):
        dup = sorted(s for s in set(steps) if steps.count(s) > 1)[0]
        raise ConfigError("step", dup, "appears in more than one snapshot entry")
    complete = sorted((e.step for e in items if e.complete), reverse=True)
    if not complete:
        return []  # nothing is safe to fall back to: delete nothing, not even partial writes
    newest = complete[0]
    doomed = set(complete[keep:])
    doomed.update(e.step for e in items if not e.complete and e.step < newest)
    return sorted(doomed)
