"""One report, built once and rendered three ways (terminal, JSON, HTML).

Why a model between the accounting and the renderers: the three outputs must
show the same figures; building them once here (merged analysis, the
restart-from-disk comparison, the time format) keeps the renderers free of
arithmetic, so a number cannot differ between the terminal and the page.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptless.goodput import (
    CATEGORIES,
    GOOGLE,
    PHASES,
    BaselineComparison,
    Estimate,
    EstimateInputs,
    IncidentView,
    JobAnalysis,
    analyze,
    estimate,
)
from ckptless.goodput import EventKind
from ckptless.mirror import MirrorLink
from ckptless.report.loader import LoadedRun

LABELS = {
    "productive": "productive", "startup": "startup", "checkpoint_save": "checkpoint save",
    "detection": "detection", "replacement_wait": "waiting for a node", "reformation": "re-formation",
    "transfer": "transfer",
    "disk_restore": "disk restore", "rollback": "rollback", "wasted_progress": "wasted progress",
    "reprotection": "re-protection", "idle": "idle", "first_step": "first step",
    "joined": "replacement joined", "incident opened": "leader: incident opened",
    "plan published": "leader: plan published", "waiting for a replacement": "leader: waiting for a replacement",
}
# What each category means, for the terminal legend and the page.
MEANING = {
    "productive": "steps that were kept",
    "startup": "first step beyond a median step (process start, warm-up)",
    "checkpoint_save": "blocking part of disk snapshots",
    "detection": "fault until every survivor knew",
    "replacement_wait": "no spare and no node for a lost rank: held until one came (--replacement-timeout)",
    "reformation": "report, plan, replacement joins, new groups",
    "transfer": "replacement pulls its image from peers",
    "disk_restore": "restore from a disk snapshot",
    "rollback": "survivors restore the resume version in memory",
    "wasted_progress": "steps and partial step discarded by the rollback",
    "reprotection": "steps slowed while mirrors were rebuilt",
    "idle": "before the first / after the last step",
}


def _nice(span: float, target: int) -> float:
    raw = span / max(target, 1)
    if raw <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    return next((m * mag for m in (1, 2, 2.5, 5) if m * mag >= raw), 10 * mag)


_CLOCK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def nice_ticks(lo: float, hi: float, target: int, clock: bool = False) -> tuple[list[float], float]:
    """Multiples of a 1/2/2.5/5 x 10^k step between lo and hi, and the step.

    With ``clock``, steps of a second or more are clock units (15 s, 5 min, 1 h, ...)."""
    step = _nice(hi - lo, target)
    if clock and step >= 1:
        raw = (hi - lo) / max(target, 1)
        step = float(next((c for c in _CLOCK_STEPS if c >= raw), 86400 * math.ceil(raw / 86400)))
    first = math.ceil(lo / step - 1e-9) * step
    n = int((hi - first) / step + 1e-9) + 1
    return [first + k * step for k in range(max(n, 0))], step


@dataclass(frozen=True)
class TimeFormat:
    """Times as the reader wants them: time of day on the wall clock, else seconds since start."""

    clock: str
    origin: float

    def at(self, t: float) -> str:
        if self.clock == "wall":
            return _dt.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]
        return f"+{t - self.origin:.3f}s"

    def tick(self, t: float, step: float) -> str:
        """An axis label with as many decimals as the tick spacing needs."""
        nd = 0 if step >= 1 else (1 if step >= 0.1 else (2 if step >= 0.01 else 3))
        if self.clock == "wall":
            d = _dt.datetime.fromtimestamp(t)
            if step >= 60:
                return d.strftime("%H:%M")
            return d.strftime("%H:%M:%S") + (f"{t % 1:.{nd}f}"[1:] if nd else "")
        return f"+{t - self.origin:.{nd}f}s"

    def ticks(self, lo: float, hi: float, target: int) -> tuple[list[float], float]:
        """Nice tick positions: whole clock units on the wall clock, from the start on the monotonic one."""
        if self.clock == "wall":
            return nice_ticks(lo, hi, target, clock=True)
        rel, step = nice_ticks(lo - self.origin, hi - self.origin, target)
        return [v + self.origin for v in rel], step

    def day(self, t: float) -> str:
        if self.clock == "wall":
            return _dt.datetime.fromtimestamp(t).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
        return "monotonic clock (no wall-clock times in these ledgers)"


@dataclass(frozen=True)
class Report:
    source: Path
    files: tuple[Path, ...]
    analysis: JobAnalysis
    estimate: Estimate
    baseline: BaselineComparison | None
    baseline_source: Path | None
    notes: tuple[str, ...] = ()

    @property
    def time(self) -> TimeFormat:
        return TimeFormat(self.analysis.clock, self.analysis.start)


def build_report(run: LoadedRun, baseline: LoadedRun | None = None,
                 inputs: EstimateInputs | None = None) -> Report:
    job = analyze(run.events)
    comp = None if baseline is None else BaselineComparison(analyze(baseline.events), job)
    links = tuple(_link_note(e.attrs) for e in run.events if e.kind is EventKind.MIRROR_LINK)
    return Report(run.path, run.files, job, estimate(job, inputs), comp,
                  None if baseline is None else baseline.path, job.notes + run.notes + links)


def _link_note(a: Any) -> str:
    """An agent's mirror-link measurement (launcher/mirror_link.py), as a line of the report."""
    rate = a.get("bits_per_s")
    link = MirrorLink.from_json({**a, "address": a.get("address", "?"),
                                 "bytes_per_s": rate / 8 if isinstance(rate, (int, float)) and rate > 0 else None})
    return f"mirrors of node {a.get('node', '?')}: {link.describe()}"


def incident_to_json(i: IncidentView) -> dict[str, Any]:
    return {
        "index": i.index, "generation": i.generation, "lost_ranks": list(i.lost_ranks),
        "decision": i.decision, "started_at": i.started_at, "started_by": i.start_source,
        "faults": [{"t": f.t, "kind": f.kind, "target": f.target} for f in i.faults],
        "detected_by": [{"rank": r, "t": t} for r, t in i.detected_by],
        "phases": {p: i.phases[p] for p in PHASES if p in i.phases},
        "phase_ends": dict(i.ends), "resumed_at": i.resumed_at, "downtime_s": i.downtime_s,
        "kill_to_first_step_s": i.kill_to_first_step_s,
        "reprotected_at": i.reprotected_at, "reprotect_s": i.reprotect_s,
        "resume_step": i.resume_step, "steps_lost": i.steps_lost, "lost_work_s": i.lost_work_s,
        "interrupted": i.interrupted, "restored_from": i.restored_from,
    }


def analysis_to_json(a: JobAnalysis) -> dict[str, Any]:
    wall = a.wall_s
    return {
        "clock": a.clock, "clock_note": a.clock_note, "start": a.start, "end": a.end, "wall_s": wall,
        "goodput": a.goodput, "productive_s": a.productive_s, "badput_s": a.badput_s,
        "seconds": {c: a.seconds[c] for c in CATEGORIES},
        "share": {c: (a.seconds[c] / wall if wall > 0 else 0.0) for c in CATEGORIES},
        "google_badput_type": dict(GOOGLE),
        "steps_done": a.steps_done, "steps_lost": a.steps_lost, "median_step_s": a.median_step_s,
        "world_size": a.world_size, "snapshot_steps": list(a.snapshot_steps),
        "incidents": [incident_to_json(i) for i in a.incidents],
        "unmatched_faults": [{"t": f.t, "kind": f.kind, "target": f.target} for f in a.unmatched_faults],
    }


def estimate_to_json(e: Estimate) -> dict[str, Any]:
    inp = e.inputs
    return {
        "label": "estimate",
        "inputs": {"restart_s": inp.restart_s, "load_s": inp.load_s, "save_s": inp.save_s,
                   "checkpoint_interval_steps": inp.interval_steps, "interval_source": inp.interval_source,
                   "source": inp.source, "step_s": e.step_s, "warmup_s": e.warmup_s},
        "failures": [{"incident": f.incident, "fault_step": f.fault_step, "lost_steps": f.lost_steps,
                      "seconds": f.seconds} for f in e.failures],
        "checkpoint_saves": e.saves, "checkpoint_save_s": e.save_total_s,
        "wall_s": e.wall_s, "goodput": e.goodput, "failure_badput_s": e.failure_badput_s,
        "ckptless_failure_badput_s": e.ckptless_failure_s, "saved_s": e.saved_s,
    }


def report_to_json(r: Report) -> dict[str, Any]:
    """The whole report as plain JSON types; the job's figures at the top level."""
    doc = analysis_to_json(r.analysis)
    doc["source"] = str(r.source)
    doc["notes"] = list(r.notes)
    doc["files"] = [str(f) for f in r.files]
    doc["restart_from_disk"] = {"estimate": estimate_to_json(r.estimate)}
    if r.baseline is not None:
        b = r.baseline
        doc["restart_from_disk"]["baseline"] = {
            "source": str(r.baseline_source), "has_failures": b.has_failures,
            "wall_delta_s": b.wall_delta_s, "mean_downtime_s": b.mean_downtime(b.baseline),
            "failure_badput_s": b.failure_badput(b.baseline), "analysis": analysis_to_json(b.baseline)}
    return doc
