"""The pure half of ``ckptless-chaos goodput``: the timed failure schedule, the checkpoint interval, the figures.

Why pure: the comparison is only as good as its inputs. The schedule is a function of
(seed, mean interval, duration, world) alone, so both systems get exactly the same failures
and a run can be replayed; the Young/Daly interval is a formula of measured numbers printed
beside it; the figures are computed from each run's own ledgers (the same merge ``ckptless
report`` uses) and the runner's launch and stop times, nothing estimated. Runners live in
:mod:`ckptless.chaos.goodput`.

The failure mix: ``kill_worker`` only (SIGKILL of one rank's training process, the commonest
interruption: Llama 3's report puts 58.7 % of its 419 on GPUs, which end one process).
Node losses and hangs are not drawn yet (docs/chaos.md, "Goodput").
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptless.errors import ConfigError
from ckptless.goodput import Event, EventKind
from ckptless.goodput import BADPUT_CATEGORIES, analyze

KINDS = ("kill_worker",)


@dataclass(frozen=True)
class TimedFault:
    """``t`` seconds after the run's launch, do ``kind`` to the process that trains ``rank`` then."""

    t: float
    rank: int
    kind: str = "kill_worker"


def draw_schedule(seed: int, every_s: float, duration_s: float, world: int) -> tuple[TimedFault, ...]:
    """Poisson failures: exponential inter-arrival times of mean ``every_s``, a uniform victim rank,
    until ``duration_s``. Only ``random.Random(seed)`` is drawn from (no clock, no global RNG)."""
    if not every_s > 0 or not math.isfinite(every_s):
        raise ConfigError("every_s", every_s, "must be a positive number of seconds")
    if not duration_s > 0:
        raise ConfigError("duration_s", duration_s, "must be > 0")
    if world < 1:
        raise ConfigError("world", world, "must be >= 1")
    rng = random.Random(seed)
    out: list[TimedFault] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / every_s)
        if t >= duration_s:
            return tuple(out)
        out.append(TimedFault(round(t, 3), rng.randrange(world)))


def load_schedule(path: Path, world: int, duration_s: float) -> tuple[TimedFault, ...]:
    """A schedule written by hand or by an earlier run's ``--json``: ``[{"t": s, "rank": r, "kind":
    "kill_worker"}, ...]`` or ``{"schedule": [...]}``. Refused with the entry named when it is bad."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("schedule", str(path), f"unreadable: {exc}") from None
    items = doc.get("schedule") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise ConfigError("schedule", str(path), "expected a list of {t, rank, kind} (or {\"schedule\": [...]})")
    out = []
    for n, it in enumerate(items):
        if not isinstance(it, dict):
            raise ConfigError(f"schedule[{n}]", it, "must be an object {t, rank, kind}")
        t, rank, kind = it.get("t"), it.get("rank"), it.get("kind", "kill_worker")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < duration_s:
            raise ConfigError(f"schedule[{n}].t", t, f"must be seconds in [0, {duration_s:g})")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ConfigError(f"schedule[{n}].rank", rank, f"must be a rank in [0, {world})")
        if kind not in KINDS:
            raise ConfigError(f"schedule[{n}].kind", kind, f"one of {list(KINDS)}")
        out.append(TimedFault(float(t), rank, kind))
    return tuple(sorted(out, key=lambda f: f.t))


def young_daly_steps(save_s: float, mtbf_s: float, step_s: float) -> int:
    """Young/Daly's optimal checkpoint interval sqrt(2 x save x MTBF), in whole steps (>= 1).

    ``save_s``: what one checkpoint costs (here: the measured time from the save's start to its
    completion marker); ``mtbf_s``: the job's mean time between failures; ``step_s``: the median step."""
    for name, v in (("save_s", save_s), ("mtbf_s", mtbf_s), ("step_s", step_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ConfigError(name, v, "must be a positive number of seconds")
    return max(1, round(math.sqrt(2.0 * save_s * mtbf_s) / step_s))


@dataclass(frozen=True)
class RunFigures:
    """One system's run, from its own ledgers: what ``--json`` writes per system."""

    system: str
    goodput: float             # productive step time / wall_s
    wall_s: float              # launch -> stop (D, or the job's own end; a failed job counts to D)
    productive_s: float
    step_s: float | None       # median steady step
    steps_kept: int            # steps completed and never rolled back: the training done
    steps_lost: int            # steps done, then lost to a rollback or a restart, and done again
    incidents: int
    faults_injected: int
    badput_s: dict[str, float] = field(default_factory=dict)  # by category; with productive they sum to wall_s
    downtime_s: list[float] = field(default_factory=list)  # per incident: its start (the kill) -> the last rank's first step
    ended: str = "stopped"     # stopped (at D) | finished | failed: ...
    extra: dict[str, Any] = field(default_factory=dict)  # ckpt_every, save_s, max_restarts, ...

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def figures(system: str, events: Sequence[Event], launch_wall: float, stop_wall: float, ended: str = "stopped",
            faults_injected: int = 0, extra: dict[str, Any] | None = None) -> RunFigures:
    """Goodput of one run from its ledgers (every rank's, the leader's, the injector's) and the
    runner's clock: wall = launch -> stop. Before the first ledger event the processes were
    starting (``launch``); after the last, the step in flight when the run was stopped (``cut``).
    Everything between is :func:`ckptless.goodput.merge.analyze`'s partition of the job's time."""
    wall = max(0.0, stop_wall - launch_wall)
    if not events:
        return RunFigures(system, 0.0, wall, 0.0, None, 0, 0, 0, faults_injected, {"launch": wall}, [], ended,
                          dict(extra or {}))
    a = analyze(events)
    badput = {c: a.seconds[c] for c in BADPUT_CATEGORIES}
    if a.clock == "wall":
        badput["launch"] = max(0.0, min(a.start, stop_wall) - launch_wall)
        badput["cut"] = max(0.0, stop_wall - max(a.end, launch_wall))
    productive = a.productive_s
    if a.clock == "wall" and a.end > stop_wall:  # (events after the stop: none unless clocks disagree)
        productive = max(0.0, productive - (a.end - stop_wall))
    if a.clock != "wall":
        wall = max(wall, a.wall_s)
    downtime = [i.downtime_s for i in a.incidents if i.downtime_s is not None]
    return RunFigures(system, 0.0 if wall <= 0 else min(1.0, productive / wall), wall, productive, a.median_step_s,
                      a.steps_done, a.steps_lost, len(a.incidents), faults_injected, badput, downtime, ended,
                      dict(extra or {}))


def save_seconds(events: Sequence[Event], completions: dict[int, float]) -> float | None:
    """Median time one checkpoint took, start (rank 0's ``snapshot_saved``) -> completion marker
    (``completions``: step -> the marker's wall time). None when no checkpoint completed."""
    starts = {e.step: e.t_wall for e in events if e.kind is EventKind.SNAPSHOT_SAVED and e.rank == 0
              and e.step is not None and e.t_wall is not None}
    xs = [completions[s] - t for s, t in starts.items() if s in completions and completions[s] >= t]
    return statistics.median(xs) if xs else None


def render(runs: Sequence[RunFigures]) -> str:
    """The side-by-side table the command prints."""
    cats = sorted({c for r in runs for c, v in r.badput_s.items() if v > 0.0005},
                  key=lambda c: (list(BADPUT_CATEGORIES) + ["launch", "cut"]).index(c))
    rows: list[tuple[str, ...]] = [("", *(r.system for r in runs))]
    rows.append(("goodput", *(f"{r.goodput:.1%}" for r in runs)))
    rows.append(("wall s", *(f"{r.wall_s:.1f}" for r in runs)))
    rows.append(("productive s", *(f"{r.productive_s:.1f}" for r in runs)))
    for c in cats:
        rows.append((f"  badput {c} s", *(f"{r.badput_s.get(c, 0.0):.1f}" for r in runs)))
    rows.append(("median step s", *("-" if r.step_s is None else f"{r.step_s:.4f}" for r in runs)))
    rows.append(("steps kept", *(str(r.steps_kept) for r in runs)))
    rows.append(("steps lost (redone)", *(str(r.steps_lost) for r in runs)))
    rows.append(("faults injected", *(str(r.faults_injected) for r in runs)))
    rows.append(("incidents", *(str(r.incidents) for r in runs)))
    rows.append(("mean downtime s", *(f"{statistics.fmean(r.downtime_s):.2f}" if r.downtime_s else "-"
                                      for r in runs)))
    rows.append(("ended", *(r.ended for r in runs)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     .rstrip() for row in rows) + "\n"
