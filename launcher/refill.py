"""Keeping a node's warm spares (``--spare-refill``): a new spare once one took a rank.

Why: ``--spares N`` is a pool that a recovery drains; without a refill the
next failure finds no spare and pays a respawn's setup on its critical path.
The agent therefore owes one new spare for every spare of its own that took a
rank, and starts it once that recovery is over: every rank this node runs
trains again in the generation that took the spare (their heartbeat files say
so), so the new spare's setup (the script's build, on this node's cores) never
competes with the recovery itself.

Pure: decisions over the slot table and heartbeat records; the agent spawns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ckptless.launcher.slots import Slot


def recovery_over(slots: Sequence[Slot], generation: int,
                  progress_of: Callable[[str], dict[str, Any] | None]) -> bool:
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


def spare_env(worker_id: str, local_rank: int, heartbeat: str, exit_file: str, standby: int | None) -> dict[str, str]:
    """What a new spare's env changes against the node's first spare's (its template)."""
    return {"CKPTLESS_WORKER_ID": worker_id, "CKPTLESS_ROLE": "spare", "LOCAL_RANK": str(local_rank),
            "CKPTLESS_HEARTBEAT_FILE": heartbeat, "CKPTLESS_EXIT_FILE": exit_file,
            "CKPTLESS_STANDBY_RANK": "" if standby is None else str(standby), "CKPTLESS_GENERATION": "0",
            "RANK": "0" if standby is None else str(standby)}
