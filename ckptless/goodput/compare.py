"""What restart-from-disk would have cost for the same run (pure).

Why two sources: the honest comparison is a measured one, a baseline run's
ledgers (``ckptless report RUN --baseline DIR``: a torchrun + DCP run of the
same job with the same faults, whose restarts bump the generation, or a
ckptless run without faults). Without one, the report still answers the
question a user asks ("what did ckptless save me?") with an *estimate* built
from explicit inputs, every one of which is printed beside the figure:

    per failure:  restart_s (kill -> all ranks re-joined, new processes)
                + load_s    (DCP load of the last checkpoint; 0 from step 0)
                + warmup_s  (this run's own first-step warm-up: a restarted job pays it again)
                + lost steps since the last checkpoint x median step time
    per run:      checkpoint saves (completed steps // interval) x save_s

The lost steps are exact for the given interval: a fault after step s loses
``s mod interval`` steps (a checkpoint is assumed at step 0). Defaults come
from docs/benchmarks.md (torchrun + DCP, 4 ranks, 64 MiB/rank, cold cache on
this 2-core machine) and torchtitan's default ``checkpoint.interval`` of 500
steps; a run that took disk snapshots uses their interval instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ckptless.goodput.merge import JobAnalysis

DEFAULT_RESTART_S = 6.37   # docs/benchmarks.md: kill -> all ranks through init_process_group (64 MiB, cold)
DEFAULT_LOAD_S = 2.30      # docs/benchmarks.md: -> DCP loaded (8.67 - 6.37 s)
DEFAULT_SAVE_S = 0.30      # DESIGN.md: async_save blocks 0.2-0.4 s per checkpoint (sync save: 0.68 s)
DEFAULT_INTERVAL = 500     # torchtitan's default checkpoint.interval (steps)
SOURCE = "docs/benchmarks.md: torchrun + DCP, 4 ranks x 64 MiB, cold cache, 2-core CPU host"


@dataclass(frozen=True)
class EstimateInputs:
    restart_s: float = DEFAULT_RESTART_S
    load_s: float = DEFAULT_LOAD_S
    save_s: float = DEFAULT_SAVE_S
    interval_steps: int = DEFAULT_INTERVAL
    interval_source: str = "torchtitan's default checkpoint.interval"
    source: str = SOURCE


@dataclass(frozen=True)
class FailureCost:
    incident: int
    fault_step: int
    lost_steps: int
    seconds: float


@dataclass(frozen=True)
class Estimate:
    """Restart-from-disk, estimated for this run's failures; every input is in ``inputs``/``step_s``/``warmup_s``."""

    inputs: EstimateInputs
    step_s: float
    warmup_s: float
    failures: tuple[FailureCost, ...]
    saves: int
    save_total_s: float
    wall_s: float
    goodput: float
    failure_badput_s: float     # what the failures cost restart-from-disk
    ckptless_failure_s: float   # what they cost ckptless (incident categories)
    run_wall_s: float

    @property
    def saved_s(self) -> float:
        """Estimated restart-from-disk wall time minus this run's (positive: ckptless was faster)."""
        return self.wall_s - self.run_wall_s


# Categories that exist only because of failures (ckptless's side of the comparison).
FAILURE_CATEGORIES = ("detection", "reformation", "transfer", "disk_restore", "rollback", "wasted_progress",
                      "reprotection")


def default_inputs(run: JobAnalysis) -> EstimateInputs:
    """The defaults, with the run's own snapshot interval when it took snapshots."""
    snaps = sorted(set(run.snapshot_steps))
    gaps = [b - a for a, b in zip(snaps, snaps[1:]) if b > a]
    if gaps:
        return EstimateInputs(interval_steps=min(gaps), interval_source="this run's disk snapshot interval")
    if len(snaps) == 1 and snaps[0] > 0:
        return EstimateInputs(interval_steps=snaps[0], interval_source="this run's first disk snapshot step")
    return EstimateInputs()


def estimate(run: JobAnalysis, inputs: EstimateInputs | None = None) -> Estimate:
    """Restart-from-disk cost of this run's incidents, from ``inputs`` and this run's step times."""
    inp = inputs or default_inputs(run)
    if inp.interval_steps < 1:
        inp = replace(inp, interval_steps=1)
    step_s = run.median_step_s or 0.0
    warmup = run.seconds["startup"]
    fails = []
    for inc in run.incidents:
        # the last step completed before the fault = resume step + steps the rollback discarded
        base = inc.resume_step if inc.resume_step is not None else 0
        fault_step = base + inc.steps_lost
        lost = fault_step % inp.interval_steps
        ckpt = fault_step - lost
        cost = inp.restart_s + (inp.load_s if ckpt > 0 else 0.0) + warmup + lost * step_s
        fails.append(FailureCost(inc.index, fault_step, lost, cost))
    saves = run.steps_done // inp.interval_steps
    save_total = saves * inp.save_s
    failure_badput = math.fsum(f.seconds for f in fails)
    ck_fail = math.fsum(run.seconds[c] for c in FAILURE_CATEGORIES)
    # Same productive work and start-up; failures and checkpoints cost what restart-from-disk pays.
    wall = run.wall_s - ck_fail - run.seconds["checkpoint_save"] + failure_badput + save_total
    goodput = 0.0 if wall <= 0 else min(1.0, run.productive_s / wall)
    return Estimate(inp, step_s, warmup, tuple(fails), saves, save_total, wall, goodput, failure_badput, ck_fail,
                    run.wall_s)


@dataclass(frozen=True)
class BaselineComparison:
    """A measured baseline beside this run: the figures a reader compares, side by side."""

    baseline: JobAnalysis
    run: JobAnalysis

    @property
    def has_failures(self) -> bool:
        return bool(self.baseline.incidents)

    @property
    def wall_delta_s(self) -> float:
        """Baseline wall minus this run's (positive: this run finished sooner)."""
        return self.baseline.wall_s - self.run.wall_s

    @staticmethod
    def mean_downtime(a: JobAnalysis) -> float | None:
        xs = [i.downtime_s for i in a.incidents if i.downtime_s is not None]
        return math.fsum(xs) / len(xs) if xs else None

    @staticmethod
    def failure_badput(a: JobAnalysis) -> float:
        return math.fsum(a.seconds[c] for c in FAILURE_CATEGORIES)
