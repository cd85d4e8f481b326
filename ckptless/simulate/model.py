"""``simulate(params, seed) -> Result``: the three systems on one seeded failure schedule (pure).

Why a pure function of (params, seed): the same inputs give the same answer (tests hold it),
the clock is simulated (a 54-day job takes milliseconds), and a search over settings
(:mod:`ckptless.simulate.recommend`) or a spread over seeds (:func:`expected`) is a loop.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ckptless.simulate.engine import CATEGORIES
from ckptless.simulate.failures import Failure, draw_failures
from ckptless.simulate.params import KINDS, Params
from ckptless.simulate.placement import p_defeat_given_f, p_defeat_per_failure
from ckptless.simulate.policies import Outcome, run_ckptless, run_restart, run_torchft

SYSTEMS = ("ckptless", "restart", "torchft")


@dataclass(frozen=True)
class SystemResult:
    name: str
    goodput: float
    seconds: dict[str, float]           # every category; they sum to the duration
    incidents: int
    lost_work_s: float
    defeats: int = 0

    @property
    def badput(self) -> dict[str, float]:
        """Badput by category, as shares of the duration (only the non-zero ones)."""
        total = sum(self.seconds.values()) or 1.0
        return {c: s / total for c, s in self.seconds.items() if c != "productive" and s > 1e-12}

    def to_json(self) -> dict[str, object]:
        return {"goodput": self.goodput, "seconds": dict(self.seconds), "badput": self.badput,
                "incidents": self.incidents, "lost_work_s": self.lost_work_s,
                "lost_work_per_failure_s": self.lost_work_s / self.incidents if self.incidents else 0.0,
                "placement_defeats": self.defeats}


@dataclass(frozen=True)
class Result:
    params: Params
    seed: int
    failures: dict[str, int]
    systems: dict[str, SystemResult]
    window_s: float                     # mean time a loss stayed unprotected (ckptless)
    p_defeat_closed: float              # per failure, closed form at that window
    p_defeat_sim: float                 # per failure, this run

    def __getitem__(self, name: str) -> SystemResult:
        return self.systems[name]


def _system(name: str, out: Outcome, duration: float) -> SystemResult:
    tl = out.timeline
    return SystemResult(name, tl.seconds["productive"] / duration, {c: tl.seconds[c] for c in CATEGORIES},
                        tl.incidents, tl.lost_work_s, out.defeats)


def simulate(params: Params, seed: int, failures: list[Failure] | None = None) -> Result:
    """Run ckptless, restart-from-disk and TorchFT-style on the same seeded failures (or on
    ``failures`` given, e.g. the kill times of a measured run: the calibration replays them)."""
    if failures is None:
        failures = draw_failures(params, seed)
    d = params.duration_s
    ck = run_ckptless(params, failures, d)
    systems = {"ckptless": _system("ckptless", ck, d),
               "restart": _system("restart", run_restart(params, failures, d), d),
               "torchft": _system("torchft", run_torchft(params, failures, d), d)}
    window = statistics.fmean(ck.windows) if ck.windows else 0.0
    return Result(params, seed, {k: sum(1 for f in failures if f.kind == k) for k in KINDS}, systems, window,
                  p_defeat_per_failure(params, window), ck.defeats / len(failures) if failures else 0.0)


@dataclass(frozen=True)
class Spread:
    """A system's goodput over many seeds: the mean (the prediction) and the 10th-90th percentiles."""

    mean: float
    p10: float
    p90: float


def expected(params: Params, seeds: int = 50, first_seed: int = 0) -> tuple[Result, dict[str, Spread]]:
    """The mean over ``seeds`` schedules (one result kept to show categories: the seed nearest the mean)."""
    runs = [simulate(params, first_seed + i) for i in range(seeds)]
    spread = {}
    for name in SYSTEMS:
        g = sorted(r[name].goodput for r in runs)
        spread[name] = Spread(statistics.fmean(g), g[int(0.1 * (len(g) - 1))], g[int(0.9 * (len(g) - 1))])
    mean_ck = spread["ckptless"].mean
    typical = min(runs, key=lambda r: abs(r["ckptless"].goodput - mean_ck))
    return typical, spread


def mean_categories(params: Params, seeds: int, first_seed: int = 0) -> dict[str, dict[str, float]]:
    """Seconds by category averaged over seeds, per system (what the report and --json show)."""
    acc: dict[str, dict[str, float]] = {s: {c: 0.0 for c in CATEGORIES} for s in SYSTEMS}
    for i in range(seeds):
        r = simulate(params, first_seed + i)
        for s in SYSTEMS:
            for c, v in r[s].seconds.items():
                acc[s][c] += v / seeds
    return acc


def gemini_table(params: Params, fs: tuple[int, ...] = (2, 3, 4, 8)) -> dict[int, float]:
    """Gemini's static view for this job: f whole nodes down at once -> P(some rank has no copy)."""
    return {f: p_defeat_given_f(params.nodes, params.replicas, f, params.placement)
            for f in fs if f <= params.nodes}
