"""Recommend K, spares, mirror_every and the snapshot interval: a small search over the model (pure).

Why a grid and not an optimiser: the settings are few and discrete, each point is a few
simulated runs (milliseconds), and a user can read the table of what was tried. Spares are
GPUs that do not train, so the objective is goodput *per GPU paid for*:
goodput x W / (W + spares); plain goodput is reported beside it. K is limited by host memory:
ckptless holds up to (2 + 2K) x S per rank (DESIGN.md, "Memory budget"), shown, not enforced.
The snapshot interval (the last resort, used only when a failure set defeats the placement)
starts from Young/Daly with the simulated rate of such defeats and is checked at half and
twice that.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from ckptless.simulate.failures import draw_failures
from ckptless.simulate.params import Params, young_daly
from ckptless.simulate.policies import run_ckptless


@dataclass(frozen=True)
class Candidate:
    replicas: int
    spares: int
    mirror_every: int
    snapshot_every_s: float
    goodput: float
    per_gpu: float
    defeats_per_day: float


def _score(p: Params, seeds: int) -> Candidate:
    g, defeats = [], 0
    for s in range(seeds):
        out = run_ckptless(p, draw_failures(p, 1000 + s), p.duration_s)
        g.append(out.timeline.seconds["productive"] / p.duration_s)
        defeats += out.defeats
    mean = statistics.fmean(g)
    return Candidate(p.replicas, p.spares, p.mirror_every, p.snapshot_every_s, mean,
                     mean * p.world / (p.world + p.spares), defeats / seeds / (p.duration_s / 86400.0))


def recommend(p: Params, seeds: int = 4) -> tuple[Candidate, list[Candidate]]:
    """The best candidate (by goodput per GPU) and every candidate tried."""
    ks = [k for k in (1, 2) if k < p.nodes] or [p.replicas]
    spare_opts = sorted({0, p.spares} | {m * p.nproc_per_node for m in (1, 2, 4, 8, 16)})
    tried = []
    for k in ks:
        for sp in spare_opts:
            for every in (1, 2, 5, 10):
                tried.append(_score(replace(p, replicas=k, spares=sp, mirror_every=every), seeds))
    best = max(tried, key=lambda c: (round(c.per_gpu, 6), -c.spares, -c.replicas))
    base = replace(p, replicas=best.replicas, spares=best.spares, mirror_every=best.mirror_every)
    defeat_rate = best.defeats_per_day / 86400.0
    if defeat_rate > 0:
        yd = young_daly(base.snapshot_block_s, 1.0 / defeat_rate)
        snaps = [yd / 2, yd, 2 * yd]
    else:  # never defeated in the runs: snapshots cost without paying back; keep a rare one
        snaps = [max(p.snapshot_every_s, 6 * 3600.0)]
    for snap in snaps:
        snap = min(max(snap, 10 * p.step_s), p.duration_s)
        c = _score(replace(base, snapshot_every_s=round(snap, 1)), seeds)
        tried.append(c)
    final = max((c for c in tried if (c.replicas, c.spares, c.mirror_every) ==
                 (best.replicas, best.spares, best.mirror_every) and c.snapshot_every_s != best.snapshot_every_s),
                key=lambda c: c.per_gpu, default=best)
    if final.per_gpu < best.per_gpu:
        final = best
    return final, tried


def memory_per_rank_gib(p: Params, k: int) -> float:
    """ckptless's host-memory bound per rank at K: (2 + 2K) x S."""
    return (2 + 2 * k) * p.state_mib / 1024.0
