"""Goodput and badput from a ledger (pure: no clocks, no files).

Why a segment walk: every instant between the job's start and its end must
land in exactly one category, so that the categories sum to the wall time
and nothing is double-counted. The walk cuts the timeline at each *boundary*
event and gives the interval ending at that event the category of the phase
that the event closes:

=============================  =====================================
interval ends with             category of that interval
=============================  =====================================
``step_done`` / first step     productive (tagged with its step)
``failure_detected``           detection (the partial step is lost;
                               with ``attrs["fault_t"]`` the part
                               before the fault is rollback)
``groups_reformed``            reformation
``transfer_done``              transfer
``rollback_done``              rollback
``disk_restore``               disk_restore
``job_start`` / ``job_end``    idle
=============================  =====================================

``snapshot_saved`` is a marker, not a boundary: an async snapshot costs time
only by slowing the steps around it, and that is where it is counted. The
markers added with the merged report (``reprotect_done``, ``fault_injected``,
``incident_opened``, ``plan_published``) are not boundaries either; the
merged, all-ranks view in :mod:`ckptless.goodput.merge` reads them.

Rollback also moves work already counted as productive: when an incident
resumes from version R (``rollback_done.step`` or ``disk_restore.step``),
every productive step segment with step > R becomes *rollback* (steps lost;
they are trained again later and counted productive then).

Only job-level events (``rank is None``) and those of one reference rank
(default 0) are read. That is one rank's view; :func:`ckptless.goodput.merge.analyze`
builds a job-level view from every rank (phases end when the last rank
reaches them) and feeds it through this same walk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from ckptless.goodput.ledger import Event, EventKind, Ledger


class Category(str, Enum):
    PRODUCTIVE = "productive"
    DETECTION = "detection"
    REFORMATION = "reformation"
    TRANSFER = "transfer"
    ROLLBACK = "rollback"
    DISK_RESTORE = "disk_restore"
    IDLE = "idle"


BADPUT = tuple(c for c in Category if c is not Category.PRODUCTIVE)

# Events that mark a moment without closing an interval of the walk.
MARKERS = frozenset({EventKind.SNAPSHOT_SAVED, EventKind.REPROTECT_DONE, EventKind.FAULT_INJECTED,
                     EventKind.INCIDENT_OPENED, EventKind.PLAN_PUBLISHED, EventKind.REPLACEMENT_WAITING,
                     EventKind.MIRROR_LINK, EventKind.GENERATION_LEFT,
                     EventKind.MEMBERSHIP_ADOPTED})

_PHASE = {
    EventKind.FAILURE_DETECTED: Category.DETECTION,
    EventKind.GROUPS_REFORMED: Category.REFORMATION,
    EventKind.TRANSFER_DONE: Category.TRANSFER,
    EventKind.ROLLBACK_DONE: Category.ROLLBACK,
    EventKind.DISK_RESTORE: Category.DISK_RESTORE,
}


@dataclass(frozen=True)
class Incident:
    """One failure, from its detection to the first step completed after it.

    ``interrupted`` is set when another failure was detected before this
    incident's first step: the time after that belongs to the next incident.
    ``lost_work_s`` is the productive time that this incident's rollback
    discarded (``steps_lost`` steps).
    """

    index: int
    generation: int
    detected_at: float
    phases: dict[Category, float]
    first_step_s: float
    lost_work_s: float
    steps_lost: int
    resume_step: int | None
    from_disk: bool
    interrupted: bool
    ended_at: float

    @property
    def downtime_s(self) -> float:
        """Detection through the first completed step (what a user waits)."""
        return math.fsum(self.phases.values()) + self.first_step_s


@dataclass(frozen=True)
class StepTime:
    """One productive step interval that was kept: the step, when it ended, how long it took."""

    step: int
    end: float
    seconds: float
    after_recovery: bool


@dataclass(frozen=True)
class GoodputReport:
    start: float
    end: float
    seconds: dict[Category, float]
    steps_done: int
    steps_lost: int
    incidents: tuple[Incident, ...] = field(default=())
    # Kept productive step intervals, in time order (for step-time statistics).
    steps: tuple[StepTime, ...] = field(default=())

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def productive_s(self) -> float:
        return self.seconds[Category.PRODUCTIVE]

    @property
    def badput(self) -> dict[Category, float]:
        return {c: self.seconds[c] for c in BADPUT}

    @property
    def goodput(self) -> float:
        """Productive time / wall time, in [0, 1]; 0 for an empty ledger."""
        total = math.fsum(self.seconds.values())
        return 0.0 if total <= 0 else min(1.0, max(0.0, self.productive_s / total))


@dataclass
class _Seg:
    category: Category
    seconds: float
    step: int | None
    incident: int | None
    end: float = 0.0
    after_recovery: bool = False


@dataclass
class _Open:
    index: int
    generation: int
    detected_at: float
    phases: dict[Category, float] = field(default_factory=dict)
    first_step_s: float = 0.0
    lost_work_s: float = 0.0
    steps_lost: int = 0
    resume_step: int | None = None
    from_disk: bool = False
    interrupted: bool = False
    ended_at: float = 0.0

    def freeze(self) -> Incident:
        return Incident(self.index, self.generation, self.detected_at, dict(self.phases),
                        self.first_step_s, self.lost_work_s, self.steps_lost, self.resume_step,
                        self.from_disk, self.interrupted, self.ended_at)


def _window(events: list[Event]) -> tuple[float, float, list[Event]]:
    starts = [e.t_monotonic for e in events if e.kind is EventKind.JOB_START]
    ends = [e.t_monotonic for e in events if e.kind is EventKind.JOB_END]
    start = starts[0] if starts else events[0].t_monotonic
    end = ends[-1] if ends else events[-1].t_monotonic
    end = max(end, start)
    return start, end, [e for e in events if start <= e.t_monotonic <= end]


def account(ledger: Ledger, ref_rank: int | None = 0) -> GoodputReport:
    """Break the job's wall time into productive time and badput by cause."""
    events = [e for e in ledger if e.rank is None or e.rank == ref_rank]
    if not events:
        return GoodputReport(0.0, 0.0, {c: 0.0 for c in Category}, 0, 0)
    start, end, events = _window(events)
    segs: list[_Seg] = []
    incidents: list[_Open] = []
    cur: _Open | None = None
    prev_t = start
    for ev in events:
        if ev.kind in MARKERS:
            continue
        dt = ev.t_monotonic - prev_t
        kind = ev.kind
        if kind in (EventKind.STEP_DONE, EventKind.FIRST_STEP_AFTER_RECOVERY):
            segs.append(_Seg(Category.PRODUCTIVE, dt, ev.step, None, ev.t_monotonic,
                             kind is EventKind.FIRST_STEP_AFTER_RECOVERY))
            if cur is not None:
                cur.first_step_s, cur.ended_at = dt, ev.t_monotonic
                cur = None
        elif kind is EventKind.FAILURE_DETECTED:
            if cur is not None:
                cur.interrupted, cur.ended_at = True, prev_t
            cur = _Open(len(incidents), ev.generation, ev.t_monotonic)
            incidents.append(cur)
            fault_t = ev.attrs.get("fault_t")
            if isinstance(fault_t, (int, float)) and not isinstance(fault_t, bool) \
                    and prev_t <= fault_t <= ev.t_monotonic:
                segs.append(_Seg(Category.ROLLBACK, fault_t - prev_t, None, cur.index))
                cur.lost_work_s += fault_t - prev_t
                dt = ev.t_monotonic - fault_t
            segs.append(_Seg(Category.DETECTION, dt, None, cur.index))
            cur.phases[Category.DETECTION] = dt
        elif kind in _PHASE:
            if cur is None:  # a phase without a detection in this view: open one anyway
                cur = _Open(len(incidents), ev.generation, prev_t)
                incidents.append(cur)
            cat = _PHASE[kind]
            segs.append(_Seg(cat, dt, None, cur.index))
            cur.phases[cat] = cur.phases.get(cat, 0.0) + dt
            cur.ended_at = ev.t_monotonic
            if kind in (EventKind.ROLLBACK_DONE, EventKind.DISK_RESTORE) and ev.step is not None:
                cur.resume_step = ev.step
                cur.from_disk |= kind is EventKind.DISK_RESTORE
                _discard_after(segs, ev.step, cur)
        else:  # job_start, job_end
            segs.append(_Seg(Category.IDLE, dt, None, cur.index if cur else None))
            if cur is not None:
                cur.ended_at = ev.t_monotonic
        prev_t = ev.t_monotonic
    if end > prev_t:  # trailing time after the last boundary (no job_end yet)
        segs.append(_Seg(Category.IDLE, end - prev_t, None, None))
    seconds = {c: math.fsum(s.seconds for s in segs if s.category is c) for c in Category}
    kept = tuple(StepTime(s.step, s.end, s.seconds, s.after_recovery) for s in segs
                 if s.category is Category.PRODUCTIVE and s.step is not None)
    return GoodputReport(start, end, seconds, len(kept), sum(i.steps_lost for i in incidents),
                         tuple(i.freeze() for i in incidents), kept)


def _discard_after(segs: list[_Seg], resume: int, incident: _Open) -> None:
    """Steps newer than the resumed version were done for nothing: move them to rollback."""
    for seg in segs:
        if seg.category is Category.PRODUCTIVE and seg.step is not None and seg.step > resume:
            seg.category, seg.incident = Category.ROLLBACK, incident.index
            incident.lost_work_s += seg.seconds
            incident.steps_lost += 1


def render_report(report: GoodputReport) -> str:
    """A plain-text table (no colours): categories with seconds and share, then incidents.

    Column widths follow the longest header or value, so no header is cut.
    """
    wall = report.wall_s
    lines = [f"goodput {report.goodput:.1%}  wall {wall:.3f}s  steps done {report.steps_done}"
             f"  steps lost {report.steps_lost}  incidents {len(report.incidents)}", ""]
    rows = [(c.value, f"{report.seconds[c]:.3f}", f"{report.seconds[c] / wall if wall > 0 else 0.0:.1%}")
            for c in Category]
    lines += _table(("category", "seconds", "share"), rows)
    if report.incidents:
        cols = (Category.DETECTION, Category.REFORMATION, Category.TRANSFER, Category.ROLLBACK,
                Category.DISK_RESTORE)
        head = ("#", "gen", *(c.value for c in cols), "first step", "downtime", "lost", "resume", "note")
        body = []
        for inc in report.incidents:
            note = ",".join(n for n, on in (("disk", inc.from_disk), ("interrupted", inc.interrupted)) if on)
            body.append((str(inc.index), str(inc.generation), *(f"{inc.phases.get(c, 0.0):.3f}" for c in cols),
                         f"{inc.first_step_s:.3f}", f"{inc.downtime_s:.3f}", str(inc.steps_lost),
                         "-" if inc.resume_step is None else str(inc.resume_step), note or "-"))
        lines += [""] + _table(head, body)
    return "\n".join(lines) + "\n"


def _table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Left-aligned first column, right-aligned numbers, widths from the widest cell."""
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]

    def fmt(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 or i == len(r) - 1 and not c[:1].isdigit() else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [fmt(head), "-" * len(fmt(head))]
    return out + [fmt(r) for r in rows]
