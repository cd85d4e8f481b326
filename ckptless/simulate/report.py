"""What ``ckptless simulate`` prints and writes: the three systems side by side (pure: text and JSON).

Why averaged over seeds: one schedule of a 5-minute run holds a handful of failures, so its
goodput is one draw; the report shows the mean over ``seeds`` schedules (the prediction) with
the 10th-90th percentiles, and the badput categories averaged the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ckptless.simulate.engine import CATEGORIES
from ckptless.simulate.model import SYSTEMS, Spread, expected, gemini_table, mean_categories
from ckptless.simulate.params import Params
from ckptless.simulate.recommend import Candidate, memory_per_rank_gib, recommend


@dataclass(frozen=True)
class Report:
    params: Params
    preset: str
    seed: int
    seeds: int
    spread: dict[str, Spread]
    seconds: dict[str, dict[str, float]]
    incidents: dict[str, float]
    lost_work_s: dict[str, float]
    defeats: float
    window_s: float
    p_defeat_closed: float
    p_defeat_sim: float
    gemini: dict[int, float]
    best: Candidate | None
    tried: int


def build(params: Params, *, preset: str = "", seed: int = 0, seeds: int = 20, search: bool = True) -> Report:
    typical, spread = expected(params, seeds=seeds, first_seed=seed)
    from ckptless.simulate.model import simulate  # one more pass for the counts (cheap)
    runs = [simulate(params, seed + i) for i in range(seeds)]
    fails = sum(sum(r.failures.values()) for r in runs)
    best, tried = recommend(params) if search else (None, [])
    return Report(
        params, preset, seed, seeds, spread, mean_categories(params, seeds, seed),
        {s: sum(r[s].incidents for r in runs) / seeds for s in SYSTEMS},
        {s: sum(r[s].lost_work_s for r in runs) / max(1, sum(r[s].incidents for r in runs)) for s in SYSTEMS},
        sum(r["ckptless"].defeats for r in runs) / seeds,
        sum(r.window_s for r in runs) / seeds, typical.p_defeat_closed,
        sum(r["ckptless"].defeats for r in runs) / fails if fails else 0.0,
        gemini_table(params), best, len(tried))


def to_json(rep: Report) -> dict[str, Any]:
    p = rep.params
    d = p.duration_s
    out: dict[str, Any] = {}
    for s in SYSTEMS:
        secs = rep.seconds[s]
        out[s] = {"goodput": rep.spread[s].mean, "goodput_p10": rep.spread[s].p10, "goodput_p90": rep.spread[s].p90,
                  "badput": {c: v / d for c, v in secs.items() if c != "productive" and v > 0},
                  "seconds": secs, "incidents": rep.incidents[s], "lost_work_per_failure_s": rep.lost_work_s[s]}
    out["ckptless"]["placement_defeats"] = rep.defeats
    # the ledger's definition (ckptless report, ckptless-chaos goodput): time inside kept steps, mirroring included
    out["ckptless"]["goodput_ledger"] = (rep.seconds["ckptless"]["productive"] + rep.seconds["ckptless"]["mirror"]) / d
    out["ckptless"]["mirror_overhead"] = p.mirror_overhead
    out["restart"]["ckpt_every_s"] = p.restart_interval_s
    out["torchft"]["groups"] = p.ft_groups
    out["placement"] = {"replicas": p.replicas, "placement": p.placement, "window_s": rep.window_s,
                        "p_defeat_per_failure_closed_form": rep.p_defeat_closed,
                        "p_defeat_per_failure_simulated": rep.p_defeat_sim,
                        "gemini_p_defeat_given_f_nodes": {str(f): v for f, v in rep.gemini.items()}}
    if rep.best is not None:
        b = rep.best
        out["recommend"] = {"replicas": b.replicas, "spares": b.spares, "mirror_every": b.mirror_every,
                            "snapshot_every_s": b.snapshot_every_s, "goodput": b.goodput,
                            "goodput_per_gpu": b.per_gpu, "host_memory_per_rank_gib": memory_per_rank_gib(p, b.replicas),
                            "restart_ckpt_every_s": p.restart_interval_s, "candidates": rep.tried}
    else:
        out["recommend"] = {}
    out["params"] = asdict(p)
    out["preset"] = rep.preset
    out["seed"], out["seeds"] = rep.seed, rep.seeds
    return out


def _dur(s: float) -> str:
    if s >= 2 * 86400:
        return f"{s / 86400:.1f} d"
    if s >= 2 * 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.3g} s"


def render(rep: Report) -> str:
    p = rep.params
    mix = ", ".join(f"{k} {v:.0%}" for k, v in p.mix.items() if v)
    lines = [
        f"ckptless simulate{' --preset ' + rep.preset if rep.preset else ''}: W={p.world} ({p.nodes} nodes x "
        f"{p.nproc_per_node}), S={p.state_mib:g} MiB/rank, step {p.step_s:g} s, job MTBF {_dur(p.mtbf_s)} ({mix}), "
        f"{_dur(p.duration_s)}; K={p.replicas} {p.placement}, mirror every {p.mirror_every}, {p.spares} spares; "
        f"{rep.seeds} schedules from seed {rep.seed}",
        "",
        f"{'':28}{'ckptless':>12}{'restart':>12}{'torchft':>12}",
        f"{'goodput (mean)':28}" + "".join(f"{rep.spread[s].mean:>12.1%}" for s in SYSTEMS),
        f"{'  p10 - p90':28}" + "".join(f"{rep.spread[s].p10:>6.1%}-{rep.spread[s].p90:<5.1%}" for s in SYSTEMS),
        f"{'failures (mean)':28}" + "".join(f"{rep.incidents[s]:>12.1f}" for s in SYSTEMS),
        f"{'lost work per failure':28}" + "".join(f"{_dur(rep.lost_work_s[s]):>12}" for s in SYSTEMS),
        "badput, share of wall time:",
    ]
    for c in CATEGORIES[1:]:
        vals = [rep.seconds[s][c] / p.duration_s for s in SYSTEMS]
        if any(v > 5e-5 for v in vals):
            lines.append(f"  {c:26}" + "".join(f"{v:>12.2%}" for v in vals))
    lines.append(f"restart-from-disk checkpoints every {_dur(p.restart_interval_s)} (save {p.save_s:.3g} s, "
                 f"load {p.load_s:.3g} s); torchft: {p.ft_groups} replica groups of {p.group_ranks} ranks")
    gem = ", ".join(f"f={f}: {v:.2e}" for f, v in rep.gemini.items())
    lines.append(f"placement (K={p.replicas}, {p.placement}): a failure defeats it with p = {rep.p_defeat_closed:.2e} "
                 f"(closed form) / {rep.p_defeat_sim:.2e} (simulated), losses unprotected {_dur(rep.window_s)} on "
                 f"average; Gemini, f whole nodes down at once: {gem}")
    if rep.best is not None:
        b = rep.best
        lines.append(f"recommend: K={b.replicas}, spares={b.spares}, mirror_every={b.mirror_every}, snapshot every "
                     f"{_dur(b.snapshot_every_s) if b.snapshot_every_s else 'never'} -> ckptless goodput {b.goodput:.1%} "
                     f"({b.per_gpu:.1%} per GPU paid, spares included; host memory <= "
                     f"{memory_per_rank_gib(p, b.replicas):.2f} GiB/rank); {rep.tried} settings tried")
    return "\n".join(lines) + "\n"
