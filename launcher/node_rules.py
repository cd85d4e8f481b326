"""The node agent's rules over facts: where this node's part in the job stands, whether the job's ranks all
finished, whether a recovery is over here, how many spares are missing, which ranks are frozen. Pure functions of the slot table, a
membership and heartbeat records; the node machine (launcher/node_machine.py) decides with them.

Why a module of its own: each rule is read (and tested) on its own, and the machine stays one concept under
the size limit (tests/unit/test_structure.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ckptless.launcher.slots import Slot
from ckptless.recovery import ExitRecord
from ckptless.recovery import Membership

Part = Literal["spare_only", "running", "finished", "spares", "moved"]


def node_part(slots: Sequence[Slot], mine: Mapping[int, str]) -> Part:
    """Where this node's part in the job stands: from its slot table and the ranks the membership it
    follows places here (``mine``: rank -> worker id, a hosted rank excluded: its host runs it).

    * ``spare_only``: no slot ever ran a rank (a spare-only or late node still waiting to serve);
    * ``running``: a slot runs a rank, or a rank placed here has not ended well here yet (a respawn
      the follower is starting, or a failure the leader has yet to re-plan);
    * ``finished``: every rank placed here ended well in the worker the membership names;
    * ``spares``: the membership places no rank here any more and live spares of ours remain;
    * ``moved``: the membership places no rank here and nothing of ours is left to serve: the job went
      on without this node (e.g. its agent was paused past ``--node-grace`` and its ranks run elsewhere).

    Why the membership and not the slots alone: between a membership that moves a rank's worker (the
    follower unassigns the old slot) and the respawn that starts it again in this node, no slot holds a
    rank; judged by the slots alone that read as "all our ranks finished", and an agent paused past the
    node grace exited 0 there, before respawning its ranks, while its job waited for them and failed
    (issue 35)."""
    if not any(s.ever_ranked for s in slots):
        return "spare_only"
    if any(s.alive and s.rank is not None for s in slots):
        return "running"
    if mine:
        by_worker = {s.worker_id: s for s in slots}
        placed = [by_worker.get(w) for w in mine.values()]
        ended_well = all(s is not None and s.succeeded and not s.alive for s in placed)
        assigned_well = all(s.succeeded for s in slots if s.rank is not None)
        return "finished" if ended_well and assigned_well else "running"
    return "spares" if any(s.spare and s.alive for s in slots) else "moved"


def all_ranks_finished(m: Membership | None, exits: Sequence[ExitRecord] | None) -> bool:
    """Every rank of the generation ended with code 0 in the worker that generation names."""
    if m is None or exits is None:
        return False
    ok = {rec.rank for rec in exits
          if 0 <= rec.rank < m.world_size and rec.exitcode == 0 and rec.worker_id == m.worker_of(rec.rank).worker_id}
    return len(ok) == m.world_size


def recovery_over(slots: Sequence[Slot], generation: int,
                  progress_of: Callable[[str], Mapping[str, Any] | None]) -> bool:
    """Every live rank of this node trains in ``generation`` or later (and there is one)."""
    ranked = [s for s in slots if s.rank is not None and s.alive]
    if not ranked:
        return False
    for s in ranked:
        p = progress_of(s.heartbeat_file)
        gen = p.get("generation") if p is not None else None
        if p is None or p.get("state") != "training" or not isinstance(gen, int) or gen < generation:
            return False
    return True


def spares_missing(slots: Sequence[Slot], wanted: int) -> int:
    """How many spares this node lacks against ``--spares`` (live, unassigned ones count)."""
    return max(0, wanted - sum(1 for s in slots if s.spare and s.alive))


@dataclass(frozen=True)
class Heartbeat:
    """One live rank's heartbeat, as the hang watcher read it: its age, and (only when older than the hang
    timeout) whether it has trained a step yet (None: not read)."""

    local_rank: int
    rank: int
    worker_id: str
    heartbeat_file: str
    age_s: float
    starting: bool | None = None


def startup_grace_s(hang_timeout: float) -> float:
    """How long a worker that has not trained a step yet may go without a heartbeat.

    Why longer than the hang timeout: before its first step a process imports
    modules and builds the script's objects, and on a loaded host C extensions
    can hold the GIL for seconds (two fresh respawns were killed as frozen at
    load 20 in the long chaos run before this).
    """
    return max(4.0 * hang_timeout, 60.0)


def frozen(timeout: float | None, beats: Sequence[Heartbeat]) -> list[Heartbeat]:
    """The ranks whose heartbeat is older than ``timeout``; one that has not trained a step yet (a fresh respawn
    or spare in its setup) gets :func:`startup_grace_s` instead, so a slow start on a busy host is not taken for
    a hang. A rank blocked in a collective on a hung peer keeps beating and is left alone."""
    if not timeout:
        return []
    return [b for b in beats if b.age_s > timeout and not (b.starting and b.age_s <= startup_grace_s(timeout))]
