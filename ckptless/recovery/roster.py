"""A compact wire form of "who runs which rank": node runs instead of one entry per rank (pure).

Why: every worker reads each new membership (its watch delivers the record),
so its size is paid W times per incident. One ``[rank, worker_id, node_id,
source]`` entry per rank made that about 100 bytes x W per worker (1.6 MB per
worker per incident at W = 16,384; 26 GB out of etcd in all), twice over
because a recovery plan repeats the assignments. A job's ranks mostly come in
runs: consecutive ranks on one node, run by workers the launcher named
``<node>/w<i>`` with consecutive i, all of one source. Such a run is one entry
``[first_rank, count, node_index, source, first_i]``; any other assignment
(a respawn, a spare, a renamed worker) is one explicit entry ``[rank,
node_index, source, worker_id]``. Node names are listed once. The record is
then O(nodes + replaced ranks) instead of O(W).

Decoding is strict: every rank 0 .. W-1 exactly once, indices in range, the
same :class:`RecoveryError` family as the rest of :mod:`ckptless.recovery.wire`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptless.errors import RecoveryError
from ckptless.recovery.decision import Assignment, Rollback

SOURCES = ("survivor", "spare", "respawn", "hosted")


def _member_index(a: Assignment) -> int | None:
    """i when ``a.worker_id`` is ``<its node>/w<i>`` (the launcher's name for its i-th worker)."""
    head, sep, tail = a.worker_id.rpartition("/w")
    if sep and head == a.node_id and tail.isdigit() and str(int(tail)) == tail:
        return int(tail)
    return None


def encode(assignments: Sequence[Assignment]) -> dict[str, Any]:
    """``{"nodes": [...], "runs": [...]}``: runs of members, explicit entries for the rest."""
    nodes: dict[str, int] = {}
    runs: list[list[Any]] = []
    open_run: list[Any] | None = None
    for a in sorted(assignments, key=lambda x: x.rank):
        node = nodes.setdefault(a.node_id, len(nodes))
        i = _member_index(a)
        if (open_run is not None and i is not None and a.rank == open_run[0] + open_run[1]
                and node == open_run[2] and a.source == open_run[3] and i == open_run[4] + open_run[1]):
            open_run[1] += 1
            continue
        if i is not None:
            open_run = [a.rank, 1, node, a.source, i]
            runs.append(open_run)
        else:
            open_run = None
            runs.append([a.rank, node, a.source, a.worker_id])
    return {"nodes": list(nodes), "runs": runs}


def decode(doc: Any, what: str) -> tuple[Assignment, ...]:
    """The assignments, rank-ordered; raises :class:`RecoveryError` naming ``what`` if malformed."""
    try:
        nodes = [str(n) for n in doc["nodes"]]
        out: list[Assignment] = []
        for entry in doc["runs"]:
            if len(entry) == 5:
                first, count, node, source, i = entry
                node_id = nodes[int(node)]
                out += [Assignment(int(first) + j, f"{node_id}/w{int(i) + j}", node_id, _source(source))
                        for j in range(int(count))]
            else:
                rank, node, source, worker_id = entry
                out.append(Assignment(int(rank), str(worker_id), nodes[int(node)], _source(source)))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise RecoveryError(f"{what}: malformed roster: {exc!r}") from exc
    out.sort(key=lambda a: a.rank)
    if [a.rank for a in out] != list(range(len(out))):
        raise RecoveryError(f"{what}: the roster does not name ranks 0..{len(out) - 1} exactly once")
    return tuple(out)


def _source(raw: Any) -> Any:
    if raw not in SOURCES:
        raise ValueError(f"source {raw!r} is not one of {SOURCES}")
    return raw


def encode_rollbacks(rollbacks: Sequence[Rollback], assignments: Sequence[Assignment]) -> list[list[Any]]:
    """Rollbacks grouped by (from, to) version as rank ranges; a rollback whose worker is not the
    rank's assigned one keeps an explicit entry ``[rank, worker_id, from, to]``."""
    worker = {a.rank: a.worker_id for a in assignments}
    grouped: dict[tuple[int, int], list[int]] = {}
    out: list[list[Any]] = []
    for r in rollbacks:
        if worker.get(r.rank) == r.worker_id:
            grouped.setdefault((r.from_version, r.to_version), []).append(r.rank)
        else:
            out.append([r.rank, r.worker_id, r.from_version, r.to_version])
    for (frm, to), ranks in grouped.items():
        out.append([frm, to, _ranges(sorted(ranks))])
    return out


def decode_rollbacks(raw: Any, assignments: Sequence[Assignment], what: str) -> tuple[Rollback, ...]:
    worker = {a.rank: a.worker_id for a in assignments}
    out: list[Rollback] = []
    try:
        for entry in raw:
            if len(entry) == 4:
                rank, worker_id, frm, to = entry
                out.append(Rollback(int(rank), str(worker_id), int(frm), int(to)))
            else:
                frm, to, ranges = entry
                out += [Rollback(r, worker[r], int(frm), int(to)) for a, b in ranges for r in range(int(a), int(b))]
    except (KeyError, TypeError, ValueError) as exc:
        raise RecoveryError(f"{what}: malformed rollbacks: {exc!r}") from exc
    return tuple(sorted(out, key=lambda r: r.rank))


def _ranges(ranks: list[int]) -> list[list[int]]:
    """Sorted ranks as half-open ``[start, stop)`` ranges."""
    out: list[list[int]] = []
    for r in ranks:
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


__all__ = ["decode", "decode_rollbacks", "encode", "encode_rollbacks"]
