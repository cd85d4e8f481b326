"""R2's pre-built spares: which ranks' images share a layout, so a spare built as one rank takes another (pure).

Why a module of its own: a spare started with ``--spare-any-rank`` runs the
script's setup once, as some standby rank, before any failure; when another
rank is lost, it may take that rank with the objects it built, without a
re-exec and without setup on the critical path, if both ranks' images have the
same *layout key* (:mod:`ckptless.state.layout`: the same tensors, shapes,
dtypes and structure). The planner asks two questions here: which spare fits
a lost rank (choosing spares, :func:`fits_prebuilt`) and, once the resume
version is known, which assigned spares take their rank as built
(:func:`prebuilt_adoptions`). Both read the layout keys the live workers
reported, for their own images and for the replicas they hold.
"""

from __future__ import annotations

from ckptless.recovery.decision import Assignment
from ckptless.recovery.facts import PlanningFacts, Worker


def layout_index(facts: PlanningFacts) -> dict[int, dict[int, str]]:
    """owner -> version -> layout key, from the live workers' reports (their replicas and their own
    images); a version reported with two
    different keys (or with none) is left out: unknown, so no spare is adopted on its strength.

    A plan asks twice (the spares' choice, then the adoptions) for the same facts: the last answer is
    kept (0.13 s each at W = 10,000). Read-only for callers."""
    if _layout_memo and _layout_memo[0][0] is facts:
        return _layout_memo[0][1]
    out = _layout_index(facts)
    _layout_memo[:] = [(facts, out)]
    return out


_layout_memo: list[tuple[PlanningFacts, dict[int, dict[int, str]]]] = []


def _layout_index(facts: PlanningFacts) -> dict[int, dict[int, str]]:
    alive = {s.worker.worker_id for s in facts.members if s.alive}
    seen: dict[tuple[int, int], set[str]] = {}
    rank_of = {s.worker.worker_id: s.rank for s in facts.members if s.alive}
    for rep in facts.reports:
        if rep.worker_id in alive:
            for f in rep.replicas:
                seen.setdefault((f.owner, f.version), set()).add(f.layout)
            for version, key in rep.own_layouts:
                seen.setdefault((rank_of[rep.worker_id], version), set()).add(key)
    out: dict[int, dict[int, str]] = {}
    for (owner, version), keys in seen.items():
        if len(keys) == 1 and "" not in keys:
            out.setdefault(owner, {})[version] = next(iter(keys))
    return out


def layouts_match(layouts: dict[int, dict[int, str]], a: int, b: int) -> bool:
    """Whether ranks ``a`` and ``b`` have the same layout key at the newest version both are known at."""
    ka, kb = layouts.get(a, {}), layouts.get(b, {})
    common = set(ka) & set(kb)
    return bool(common) and ka[max(common)] == kb[max(common)]


def fits_prebuilt(w: Worker, rank: int, layouts: dict[int, dict[int, str]]) -> bool:
    """A pre-built ``any_rank`` spare built as another rank whose image has ``rank``'s layout."""
    return (w.any_rank and w.standby_rank is not None and w.standby_rank != rank
            and layouts_match(layouts, w.standby_rank, rank))


def prebuilt_adoptions(facts: PlanningFacts, assignments: list[Assignment], version: int) -> tuple[int, ...]:
    """R2: the ranks whose assigned spare takes them with the objects it built as another rank: both
    ranks' images have the same layout key at ``version``, the one the plan resumes at (the choice of
    spare looked at the newest version both were known at; the adoption needs the exact one)."""
    by_id = {w.worker_id: w for w in facts.spares}
    layouts = layout_index(facts)
    out = []
    for a in assignments:
        w = by_id.get(a.worker_id) if a.source == "spare" else None
        if w is None or not w.any_rank or w.standby_rank is None or w.standby_rank == a.rank:
            continue
        mine, theirs = layouts.get(w.standby_rank, {}).get(version), layouts.get(a.rank, {}).get(version)
        if mine is not None and mine == theirs:
            out.append(a.rank)
    return tuple(sorted(out))
