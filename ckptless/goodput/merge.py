"""The job's view of a run, merged from every rank's ledger (pure: no clocks, no files).

Why merge at all: one rank's ledger tells one rank's story. The survivor that
noticed a kill first, the replacement that did the transfer and rank 0 each
saw a different part of an incident, so a report built from rank 0 alone
showed ``detection 0.000`` when another rank noticed first and disagreed
with the replacement's own file. Here every rank's events are merged per
incident, where an incident is one generation change (generation N-1 fails,
generation N resumes). Where an incident starts and where each of its phases
ends is :mod:`ckptless.goodput.incidents` (in short: it starts at the kill, the
leader's or a rank's first signal; every phase ends at the LAST rank, never
before the previous one, so the phases are consecutive and sum to the
downtime). From those boundaries:

* kill -> first step runs from the injection to the last rank's
  ``first_step_after_recovery``;
* re-protection (background) runs from there to the last ``reprotect_done``.

The merged boundaries become one job-level ledger that goes through the same
tested segment walk as before (:func:`ckptless.goodput.accounting.account`),
so the categories still partition the wall time exactly. Three refinements
then move time out of *productive*, following Google's ml-goodput-measurement
where its categories apply (see :data:`GOOGLE`):

* ``startup``: the first step's excess over the median step (PROGRAM_STARTUP);
* ``checkpoint_save``: the blocking part of disk snapshots (``block_s``);
* ``replacement_wait``: the part of *reformation* the job spent waiting for a replacement node
  (``--replacement-timeout``): from the leader's ``replacement_waiting`` to its next plan;
* ``reprotection``: excess over the median step of every step that overlaps
  an incident's re-protection window, from the resume to the last
  ``reprotect_done`` (only the first step when no rank wrote that marker).
  Re-protection that did not slow a step costs nothing.

Clocks: events are placed by ``t_wall`` when they have it. Old ledgers have
none; then everything is in monotonic seconds (one host assumed) and
:attr:`JobAnalysis.clock_note` says so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ckptless.goodput.accounting import Category, StepTime, account
from ckptless.goodput.incidents import (
    PHASE_KIND, Fault, IncidentBounds, assign_faults, attr_number, clamp_in_order, collect_incidents, incident_bounds,
    restore_summary,
)
from ckptless.goodput.ledger import AttrValue, Event, EventKind, Ledger

K = EventKind

# Job-level categories, in the order reports show them.
CATEGORIES = ("productive", "startup", "checkpoint_save", "detection", "replacement_wait", "reformation", "transfer",
              "disk_restore", "rollback", "wasted_progress", "reprotection", "idle")
BADPUT_CATEGORIES = CATEGORIES[1:]
# The ml-goodput-measurement BadputType each category corresponds to.
GOOGLE = {
    "productive": "goodput",
    "startup": "PROGRAM_STARTUP",
    "checkpoint_save": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    "detection": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "reformation": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "replacement_wait": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "transfer": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "disk_restore": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "rollback": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "wasted_progress": "WASTED_PROGRESS_FROM_DISRUPTION",
    "reprotection": "CUSTOM_BADPUT_EVENTS",
    "idle": "OTHER",
}
# Consecutive phases of one incident, in order (each ends at the last rank's event).
PHASES = ("detection", "reformation", "transfer", "disk_restore", "rollback", "first_step")
_STEP_KINDS = (K.STEP_DONE, K.FIRST_STEP_AFTER_RECOVERY)


@dataclass(frozen=True)
class IncidentView:
    """One generation change, seen by all ranks (times on the report's clock)."""

    index: int
    generation: int
    lost_ranks: tuple[int, ...]
    faults: tuple[Fault, ...]
    decision: str | None
    started_at: float
    start_source: str
    detected_by: tuple[tuple[int | None, float], ...]
    ends: dict[str, float]
    phases: dict[str, float]
    marks: tuple[tuple[int | None, str, float], ...]  # (rank, phase or "joined", t): each rank's own view
    resumed_at: float | None
    reprotected_at: float | None
    resume_step: int | None
    steps_lost: int
    lost_work_s: float
    interrupted: bool
    restored_from: str = ""  # which tier served each rank (incidents.restore_summary)

    @property
    def downtime_s(self) -> float | None:
        """Incident start (kill if known) to the last rank's first step; None if it never resumed."""
        return None if self.resumed_at is None else self.resumed_at - self.started_at

    @property
    def kill_to_first_step_s(self) -> float | None:
        """Injection to the last rank's first step; only where an injection time is known."""
        if self.resumed_at is None or not self.faults:
            return None
        return self.resumed_at - min(f.t for f in self.faults)

    @property
    def reprotect_s(self) -> float | None:
        """Background re-protection after the first step (0 if it finished before that)."""
        if self.resumed_at is None or self.reprotected_at is None:
            return None
        return max(0.0, self.reprotected_at - self.resumed_at)


@dataclass(frozen=True)
class RankTrack:
    """One rank's steps and lives, for the timeline: (t, step, generation) and (start, end, role)."""

    rank: int
    steps: tuple[tuple[float, int, int], ...]
    lives: tuple[tuple[float, float, str], ...]


@dataclass(frozen=True)
class JobAnalysis:
    clock: str
    clock_note: str
    start: float
    end: float
    seconds: dict[str, float]
    steps_done: int
    steps_lost: int
    median_step_s: float | None
    incidents: tuple[IncidentView, ...] = ()
    unmatched_faults: tuple[Fault, ...] = ()
    ranks: tuple[RankTrack, ...] = ()
    snapshot_steps: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def productive_s(self) -> float:
        return self.seconds["productive"]

    @property
    def badput_s(self) -> float:
        return math.fsum(self.seconds[c] for c in BADPUT_CATEGORIES)

    @property
    def goodput(self) -> float:
        total = math.fsum(self.seconds.values())
        return 0.0 if total <= 0 else min(1.0, max(0.0, self.productive_s / total))

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def _clock(events: Sequence[Event]) -> tuple[str, str, list[float]]:
    """Each event's time on one clock: wall where known, else monotonic (+ the median offset)."""
    walls = [e.t_wall - e.t_monotonic for e in events if e.t_wall is not None]
    if not walls:
        return ("monotonic", "these ledgers have no wall-clock times (written before t_wall existed): "
                "times are monotonic seconds, one host assumed", [e.t_monotonic for e in events])
    offset = statistics.median(walls)
    times = [e.t_wall if e.t_wall is not None else e.t_monotonic + offset for e in events]
    missing = len(events) - len(walls)
    note = "" if not missing else (f"{missing} of {len(events)} events have no wall-clock time: placed at their "
                                   f"monotonic time + the median wall-monotonic offset ({offset:.3f} s)")
    return "wall", note, times


_KIND_ORDER = {k: n for n, k in enumerate(EventKind)}


def _order(p: tuple[float, Event]) -> tuple[object, ...]:
    """Time, then a total order on everything else: ties never depend on the order files were read."""
    t, e = p
    return (t, _KIND_ORDER[e.kind], -1 if e.rank is None else e.rank, e.generation,
            -1 if e.step is None else e.step, e.t_monotonic, sorted((k, repr(v)) for k, v in e.attrs.items()))


def _freeze(v: IncidentBounds, index: int, steps_lost: int, lost_work_s: float) -> IncidentView:
    """The report's record of one incident, its phases as durations."""
    i = v.inc
    phases: dict[str, float] = {}
    prev = v.started
    for name in PHASES[:-1]:
        if name in v.bounds:
            phases[name] = v.bounds[name] - prev
            prev = v.bounds[name]
    if v.resumed is not None:
        phases["first_step"] = v.resumed - prev
    resume = min(i.resume) if i.resume else (min(i.disk_step) if i.disk_step else None)
    return IncidentView(
        index=index, generation=i.gen, lost_ranks=tuple(sorted(i.lost or i.replaced)),
        faults=tuple(sorted(i.faults, key=lambda f: f.t)),
        decision=i.decision or ("memory" if i.first else None), started_at=v.started,
        start_source=v.source, detected_by=tuple(sorted(i.detect.items(), key=lambda p: p[1])),
        ends=dict(v.bounds), phases=phases, marks=tuple(i.marks), resumed_at=v.resumed,
        reprotected_at=max(i.reprotect) if i.reprotect else None, resume_step=resume,
        steps_lost=steps_lost, lost_work_s=lost_work_s, interrupted=v.interrupted,
        restored_from=restore_summary(i.restored))


def _job_ledger(tl: list[tuple[float, Event]], views: list[IncidentBounds], job_start: float,
                job_end: float) -> Ledger:
    """First start, last end, the slowest rank's time of each step, and the merged boundaries."""
    broken = {v.inc.gen - 1: v.started for v in views}
    step_t: dict[tuple[int, int], tuple[float, bool]] = {}
    for t, e in tl:
        if e.kind in _STEP_KINDS and e.step is not None:
            if e.generation in broken and t > broken[e.generation]:
                continue  # finished after its generation's fault: incident time, not a step
            old = step_t.get((e.generation, e.step), (t, False))
            step_t[(e.generation, e.step)] = (max(old[0], t), old[1] or e.kind is K.FIRST_STEP_AFTER_RECOVERY)
    synth: list[tuple[float, int, Event]] = [(job_start, 0, Event(K.JOB_START, job_start))]
    for (gen, step), (t, first) in step_t.items():
        synth.append((t, 2, Event(K.FIRST_STEP_AFTER_RECOVERY if first else K.STEP_DONE, t, None, gen, step)))
    for v in views:
        i = v.inc
        resume = min(i.resume) if i.resume else None
        det = v.bounds.get("detection", v.started)
        attrs: dict[str, AttrValue] = {"fault_t": v.started} if v.started < det else {}
        synth.append((det, 1, Event(K.FAILURE_DETECTED, det, None, max(i.gen - 1, 0), None, attrs)))
        for name, t in v.bounds.items():
            if name != "detection":
                at = resume if name == "rollback" else (
                    min(i.disk_step) if name == "disk_restore" and i.disk_step else None)
                synth.append((t, 1, Event(PHASE_KIND[name], t, None, i.gen, at)))
    synth.append((job_end, 3, Event(K.JOB_END, job_end)))
    synth.sort(key=lambda x: (x[0], x[1]))
    return Ledger(e for _, _, e in synth)


def analyze(events: Iterable[Event]) -> JobAnalysis:
    """Merge every rank's events into a job-level report (see the module docstring for the rules)."""
    evs = list(events)
    empty = {c: 0.0 for c in CATEGORIES}
    if not evs:
        return JobAnalysis("monotonic", "empty ledger", 0.0, 0.0, empty, 0, 0, None)
    clock, note, times = _clock(evs)
    tl = sorted(zip(times, evs), key=_order)
    base = min(e.generation for e in evs)
    raw, faults = collect_incidents(tl, base)
    order = [raw[n] for n in sorted(raw)]
    unmatched = assign_faults(order, faults)
    starts = [t for t, e in tl if e.kind is K.JOB_START]
    ends = [t for t, e in tl if e.kind is K.JOB_END]
    job_start = min(starts) if starts else tl[0][0]
    job_end = max(max(ends) if ends else tl[-1][0], job_start)

    views = [incident_bounds(i, job_start) for i in order]
    clamp_in_order(views)

    rep = account(_job_ledger(tl, views, job_start, job_end), ref_rank=None)
    seconds = {c: 0.0 for c in CATEGORIES}
    for cat in Category:
        seconds[cat.value] += rep.seconds[cat]
    wasted = math.fsum(x.lost_work_s for x in rep.incidents)
    seconds["wasted_progress"] = min(wasted, seconds["rollback"])
    seconds["rollback"] = max(0.0, seconds["rollback"] - wasted)
    incidents = []
    walked = list(rep.incidents)  # the walk's incidents open at our detection ends, in the same order
    for n, v in enumerate(views):
        det = v.bounds.get("detection", v.started)
        while walked and walked[0].detected_at < det:
            walked.pop(0)
        acc = walked.pop(0) if walked and walked[0].detected_at == det else None
        incidents.append(_freeze(v, n, acc.steps_lost if acc else 0, acc.lost_work_s if acc else 0.0))
    _replacement_waits(seconds, views)
    median = _refine(seconds, rep.steps, incidents, tl)
    snaps = tuple(sorted({e.step for _, e in tl if e.kind is K.SNAPSHOT_SAVED and e.step is not None}))
    return JobAnalysis(clock, note, rep.start, rep.end, seconds, rep.steps_done, rep.steps_lost, median,
                       tuple(incidents), tuple(unmatched), _tracks(tl), snaps,
                       tuple(x for x in (note,) if x))


def _replacement_waits(seconds: dict[str, float], views: Sequence[IncidentBounds]) -> None:
    """Move each incident's wait for a replacement node out of *reformation*: from the leader's first
    ``replacement_waiting`` to its first plan after it, within the incident's re-formation phase."""
    for v in views:
        waits = [t for _, name, t in v.inc.marks if name == "waiting for a replacement"]
        if not waits:
            continue
        w0 = min(waits)
        plans = [t for _, name, t in v.inc.marks if name == "plan published" and t >= w0]
        end = v.bounds.get("reformation")
        hi = min(plans) if plans else end
        if end is not None and hi is not None:
            hi = min(hi, end)
        lo = max(w0, v.bounds.get("detection", v.started))
        d = max(0.0, min((hi if hi is not None else lo) - lo, seconds["reformation"]))
        seconds["reformation"] -= d
        seconds["replacement_wait"] += d


def _refine(seconds: dict[str, float], kept: Sequence[StepTime], incidents: Sequence[IncidentView],
            tl: list[tuple[float, Event]]) -> float | None:
    """Move snapshot blocking, startup and re-protection slowdown out of productive; returns the median step."""
    if not kept:
        return None
    left = [s.seconds for s in kept]

    def move(idx: int, amount: float, cat: str) -> None:
        amount = max(0.0, min(amount, left[idx]))
        left[idx] -= amount
        seconds[cat] += amount
        seconds["productive"] -= amount

    blocks: dict[int, list[tuple[float, float]]] = {}
    for t, e in tl:
        b = attr_number(e.attrs.get("block_s")) if e.kind is K.SNAPSHOT_SAVED and e.step is not None else None
        if b is not None and e.step is not None:
            blocks.setdefault(e.step, []).append((t, b))
    for idx, s in enumerate(kept):
        hits = [b for t, b in blocks.get(s.step, []) if s.end - s.seconds - 1e-9 <= t <= s.end + 1e-9]
        if hits:
            move(idx, max(hits), "checkpoint_save")
    first_inc = min((i.started_at for i in incidents), default=math.inf)
    startup_idx = 0 if kept[0].end <= first_inc and not kept[0].after_recovery else None
    normal = [left[i] for i, s in enumerate(kept) if i != startup_idx and not s.after_recovery]
    median = statistics.median(normal or left)
    if startup_idx is not None:
        move(startup_idx, left[startup_idx] - median, "startup")
    for inc in incidents:
        if inc.resumed_at is None:
            continue
        lo = max([inc.started_at, *inc.ends.values()])
        hi = max(inc.resumed_at, inc.reprotected_at or inc.resumed_at)
        for idx, s in enumerate(kept):
            if idx != startup_idx and s.end > lo and s.end - s.seconds < hi:
                move(idx, left[idx] - median, "reprotection")
    return median


def _tracks(tl: list[tuple[float, Event]]) -> tuple[RankTrack, ...]:
    by_rank: dict[int, list[tuple[float, Event]]] = {}
    for t, e in tl:
        if e.rank is not None:
            by_rank.setdefault(e.rank, []).append((t, e))
    out = []
    for rank in sorted(by_rank):
        evs = by_rank[rank]
        steps = tuple((t, e.step, e.generation) for t, e in evs if e.kind in _STEP_KINDS and e.step is not None)
        lives: list[tuple[float, float, str]] = []
        for t, e in evs:
            if e.kind is K.JOB_START or not lives:
                lives.append((t, t, str(e.attrs.get("role", "member"))))
            else:
                lives[-1] = (lives[-1][0], t, lives[-1][2])
        out.append(RankTrack(rank, steps, tuple(lives)))
    return tuple(out)
