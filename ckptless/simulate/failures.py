"""The failure process (pure, seeded): when, what kind, where.

Why one list drawn up front: the three policies are compared on the *same* failures
(common random numbers), as the measured side-by-side run compares both systems under one
schedule. Arrivals are a Poisson process of the job's rate 1 / mtbf (every device and node
together: independent exponential lifetimes, as the Llama 3 report and Meta's reliability
study treat them); each arrival draws its class from the mix and a uniform place. A ``node``
failure takes all P ranks of its node at once: the correlated case that defeats a placement
which put a rank's mirror on its own node, and that node-aware placement is built for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ckptless.simulate.params import KINDS, Params


@dataclass(frozen=True)
class Failure:
    t: float           # seconds since the job's start
    kind: str          # one of params.KINDS
    node: int
    local: int | None  # the rank's index on its node; None: the whole node


def draw_failures(p: Params, seed: int, horizon_s: float | None = None) -> list[Failure]:
    """Every failure in [0, horizon) (default the job's duration), in time order."""
    rng = random.Random(seed)
    horizon = p.duration_s if horizon_s is None else horizon_s
    mix = p.mix
    weights = [mix[k] for k in KINDS]
    out: list[Failure] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / p.mtbf_s)
        if t >= horizon:
            return out
        kind = rng.choices(KINDS, weights)[0]
        node = rng.randrange(p.nodes)
        local = None if kind == "node" else rng.randrange(p.nproc_per_node)
        out.append(Failure(t, kind, node, local))


def rates(p: Params) -> dict[str, float]:
    """Per-unit failure rates (1/s): per rank for the rank-level classes, per node for ``node``."""
    total = 1.0 / p.mtbf_s
    mix = p.mix
    return {"rank": total * (mix["software"] + mix["accelerator"]) / p.world, "node": total * mix["node"] / p.nodes}
