"""The disk snapshot a whole-job restart without a coordinator resumes from (torchrun's restarts of the
plain init), agreed by every rank while each reads only its own files.

Why: the first version had every rank call ``choose_snapshot``, which reads and checksums every rank's
files of each candidate: O(W x S) bytes per rank, O(W^2 x S) for the job (at W = 1,000 every rank would
read the whole job's checkpoint at each restart). Every rank reading the same bytes was also how they
agreed. Here each rank checks only its own part of a candidate (``verify_rank``: the marker, its part
record, its files' sizes and checksums) and the ranks vote through the generation's store:

* rank 0 lists the candidates (the job's complete ``step_*`` directories, newest first) and publishes
  the list, so every rank votes on the same steps in the same order (a shared filesystem's listing
  may differ between nodes for a moment);
* for each candidate, a rank whose files fail adds to the step's ``bad`` counter, then every rank adds
  to ``votes``; the rank whose vote is the W-th sets ``all``; every rank waits for ``all`` (one blocking
  ``wait``, no polling) and reads ``bad``: zero takes the step on every rank, anything else passes it over
  on every rank. Counters are added before the vote that completes them, so ``bad`` is final at ``all``.

Cost per rank per candidate: O(S) bytes read (its own files; ``load_snapshot`` reads them once more to
restore), 3-5 store operations (and 1-2 once for the list), latency one round trip after the last vote. Store keys: O(1) per
candidate. Every key is under the generation (torchrun's restart count), so a restart never reads an
earlier round's votes while the restart count rises (a membership change under multi-node torchrun does
not raise it: such a reuse is detected where it shows and refused, :func:`_reused`). A rank that never
votes (it died) fails the others after ``wait_s`` (the recovery timeout) with a :class:`RecoveryError`;
torchrun then restarts the round.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from ckptless.errors import RecoveryError, SnapshotError
from ckptless.snapshot import MARKER, SnapshotInfo, scan_steps, step_dir, verify_rank

log = logging.getLogger(__name__)

T = TypeVar("T")


def choose_agreed(directory: Path | str, job_id: str, rank: int, world_size: int, store: dist.Store,
                  generation: int, wait_s: float) -> SnapshotInfo | None:
    """The newest complete snapshot whose files verify on every rank, the same on every rank; None if none.

    Collective: every rank of the job calls it with the same ``directory``, ``job_id``, ``world_size``
    and ``generation``. ``wait_s``: how long a rank waits for the others, for rank 0's list and at each
    vote, plus the time its own part would take to read at :data:`SLOWEST_READ_BPS` and twice what its
    own check took (a rank on a cold cache or a slower disk is not taken for one that never votes).
    Raises :class:`RecoveryError` when the generation's keys were already used (see :func:`_reused`).
    """
    prefix = f"ckptless/gen{generation}/plain-resume"
    for step in _candidates(directory, job_id, rank, store, prefix, time.monotonic() + wait_s):
        path = step_dir(directory, job_id, step)
        info: SnapshotInfo | None = None
        started = time.monotonic()
        try:
            info = verify_rank(path, job_id, world_size, rank)
        except Exception as exc:  # noqa: BLE001 - any failure is a "bad" vote, never a rank that does not vote
            log.warning("rank %d: its part of the snapshot of step %d does not verify: %s", rank, step, exc)
        now = time.monotonic()
        allowance = wait_s + 2 * (now - started) + _part_bytes(path, rank) / SLOWEST_READ_BPS
        bad = _vote(store, f"{prefix}/step{step}", info is not None, world_size, now + allowance)
        if not bad:
            return info
        log.warning("rank %d: the snapshot of step %d passed over: %d rank(s) of %d found their part bad",
                    rank, step, bad, world_size)
    return None


#: The slowest read a rank's own check is allowed before the others give up on its vote (bytes per second).
SLOWEST_READ_BPS = 50e6


def _part_bytes(path: Path, rank: int) -> int:
    try:
        return sum(f.stat().st_size for f in (path / f"rank{rank}").iterdir() if f.is_file())
    except OSError:
        return 0


def _candidates(directory: Path | str, job_id: str, rank: int, store: dist.Store, prefix: str,
                deadline: float) -> list[int]:
    """Rank 0's list of complete snapshots, newest first, as every rank's (JSON, never pickled).

    Rank 0 publishes an error in place of the list when it cannot list the directory, so that the
    others raise at once instead of at the deadline."""
    key = f"{prefix}/candidates"
    if rank == 0:
        try:
            steps: Any = [s for s, p in scan_steps(directory, job_id) if (p / MARKER).exists()]
        except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here
            doc = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
            _call(lambda: store.set(key, doc), "publish the candidates")
            raise
        doc = json.dumps(steps)
        if _call(lambda: store.compare_set(key, "", doc), "publish the candidates") != doc.encode():
            raise _reused(prefix, "rank 0's list of snapshots was already there")
        return list(steps)
    _call(lambda: store.wait([key], _left(deadline)), "wait for rank 0's candidates")
    raw = _call(lambda: store.get(key), "read rank 0's candidates")
    try:
        steps = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecoveryError(f"rank 0's list of snapshots in the store is not JSON: {exc}") from exc
    if isinstance(steps, dict) and "error" in steps:
        raise RecoveryError(f"rank 0 could not list the snapshots: {steps['error']}")
    if not isinstance(steps, list) or not all(type(s) is int and s >= 0 for s in steps):
        raise RecoveryError(f"rank 0's list of snapshots in the store is not a list of steps: {steps!r:.200}")
    return steps


def _vote(store: dist.Store, key: str, ok: bool, world_size: int, deadline: float) -> int:
    """This rank's vote on one step; returns how many ranks voted it bad (0: every rank takes it)."""
    if not ok:
        _call(lambda: store.add(f"{key}/bad", 1), "vote")
    votes = _call(lambda: store.add(f"{key}/votes", 1), "vote")
    if votes > world_size:
        raise _reused(key, f"vote {votes} of {world_size}")
    if votes == world_size:
        _call(lambda: store.set(f"{key}/all", "1"), "close the vote")
    _call(lambda: store.wait([f"{key}/all"], _left(deadline)), f"wait for every rank's vote on {key}")
    bad = _call(lambda: store.add(f"{key}/bad", 0), "count the vote")
    if not ok and bad == 0:
        raise _reused(key, "this rank's bad vote is not counted")
    return bad


def _reused(key: str, seen: str) -> RecoveryError:
    """Keys of this generation from an earlier round: torchrun keeps its store across restarts, and a restart
    for a membership change (multi-node, ``--nnodes MIN:MAX``) does not raise the restart count the
    generation comes from. Refused rather than risk ranks resuming from different steps."""
    return RecoveryError(f"agreeing on the disk snapshot to resume from: {key}: {seen}; the store holds an "
                         "earlier round's keys under this generation (a torchrun restart that did not raise "
                         "TORCHELASTIC_RESTART_COUNT, as a membership change does); set CKPTLESS_GENERATION "
                         "to a number not used before in this job, or run under ckptless-run")


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _call(fn: Callable[[], T], what: str) -> T:
    """A store call; its failure (a timeout: a rank that never voted, or the store gone) as RecoveryError."""
    try:
        return fn()
    except (RuntimeError, OSError) as exc:
        raise RecoveryError(f"agreeing on the disk snapshot to resume from: could not {what}: {exc}") from exc
