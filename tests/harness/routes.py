"""What a recovery plan's routes are, for the e2e tests' assertions and their failure messages.

Why a helper: which memory route the planner takes for a lost rank (its own image on its node, R9; a
copy a survivor adopts, R11; a survivor's replica) depends on facts a test does not control (where a
kill lands in a mirror round), so a test asserts what the plan promises (every lost rank from the memory
of a live node, at the plan's version) and prints the routes in full when it fails: a plan's repr in an
assertion message is truncated.
"""

from __future__ import annotations

from ckptless.recovery import RecoveryPlan


def memory_routes(d: RecoveryPlan) -> dict[int, list[str]]:
    """Each lost rank's routes to the plan's version that stay in a live node's memory: ``R9`` (its own
    image on its node), ``R11`` (a copy a survivor adopts and serves), ``peer`` (a survivor's replica).
    A transfer counts only when every holder and stripe source is a survivor (an adopter is one)."""
    v = d.resume_version
    survivors = {x.worker_id for x in d.assignments if x.source == "survivor"}
    adopted = {x.owner for x in d.adoptions if x.version == v and x.worker_id in survivors}
    routes: dict[int, list[str]] = {r: [] for r in d.lost_ranks}
    for x in d.node_local:
        if x.rank in routes and x.version == v:
            routes[x.rank].append("R9")
    for t in d.transfers:
        if (t.owner in routes and t.version == v and t.holders and set(t.holders) <= survivors
                and all(s.source in survivors for s in t.stripes)):
            routes[t.owner].append("R11" if t.owner in adopted else "peer")
    return routes


def describe_routes(d: RecoveryPlan) -> str:
    """The plan's routes in full, one per line (a plan's repr is truncated in an assertion's message)."""
    lines = [f"resume v{d.resume_version}, lost {d.lost_ranks}, generation {d.generation}"]
    lines += [f"  assignment {x}" for x in d.assignments]
    lines += [f"  node_local {x}" for x in d.node_local]
    lines += [f"  adoption {x}" for x in d.adoptions]
    lines += [f"  transfer {x}" for x in d.transfers]
    lines += [f"  rollback {x}" for x in d.rollbacks]
    return "\n".join(lines)
