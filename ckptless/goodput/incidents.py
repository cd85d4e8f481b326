"""Incidents, reconstructed from every rank's events: which events belong to which, and where each phase ends.

An incident is one generation change (generation N-1 fails, generation N
resumes). Merged over all ranks:

* the incident starts at the earliest of its ``fault_injected`` (the kill),
  ``incident_opened`` (the leader) and any rank's ``failure_detected``;
* detection ends when the last survivor (or the leader) knows;
* each later phase (re-formation, transfer, disk restore, rollback, first
  step) ends when the LAST rank reaches it, and never before the previous
  phase ended, so the phases are consecutive and sum to the downtime;
* a fault belongs to the first incident signalled after it, unless its target
  is known not to be lost there (a slowed worker, an etcd restart);
* a later incident never starts before an earlier one; an earlier one that had
  not resumed when the next started was interrupted, and the rest is the next's.

Why its own module: these rules decide *what happened* from a merged, ordered
timeline; :mod:`ckptless.goodput.merge` then decides what it *cost* (the
job-level ledger, the accounting walk, the refinements) and builds the
report's records. Pure: no clocks, no files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ckptless.goodput.ledger import AttrValue, Event, EventKind

K = EventKind

#: A consecutive phase of an incident -> the event that ends it (on the last rank to send one).
PHASE_KIND = {"reformation": K.GROUPS_REFORMED, "transfer": K.TRANSFER_DONE,
              "disk_restore": K.DISK_RESTORE, "rollback": K.ROLLBACK_DONE}


@dataclass(frozen=True)
class Fault:
    """An injected (or detector-reported) fault: when, what, against whom."""

    t: float
    kind: str
    target: str
    rank: int | None


def attr_number(v: AttrValue) -> float | None:
    """An event attribute as a number (None if it is not one; a bool is not)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _lost(text: AttrValue) -> tuple[int, ...]:
    if isinstance(text, int) and not isinstance(text, bool):
        return (text,)
    if not isinstance(text, str):
        return ()
    return tuple(sorted({int(p) for p in text.replace(";", ",").split(",") if p.strip().isdigit()}))


def _fault(t: float, e: Event) -> Fault:
    target = e.attrs.get("target", e.attrs.get("rank", e.rank))
    rank = int(target) if isinstance(target, int) and not isinstance(target, bool) else (
        int(target) if isinstance(target, str) and target.isdigit() else None)
    return Fault(t, str(e.attrs.get("kind", "fault")), "-" if target is None else str(target), rank)


@dataclass
class IncidentEvidence:
    """Everything every rank said about one incident (generation ``gen``), as collected."""

    gen: int
    detect: dict[int | None, float] = field(default_factory=dict)
    opened: list[float] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    phase: dict[str, list[float]] = field(default_factory=dict)
    first: list[float] = field(default_factory=list)
    reprotect: list[float] = field(default_factory=list)
    any_t: list[float] = field(default_factory=list)
    lost: set[int] = field(default_factory=set)
    replaced: set[int] = field(default_factory=set)
    decision: str | None = None
    resume: list[int] = field(default_factory=list)
    disk_step: list[int] = field(default_factory=list)
    marks: list[tuple[int | None, str, float]] = field(default_factory=list)
    restored: dict[int, dict[str, AttrValue]] = field(default_factory=dict)  # rank -> source, bytes, replica_bytes

    def signal(self) -> float | None:
        ts = list(self.detect.values()) + self.opened
        return min(ts) if ts else (min(self.any_t) if self.any_t else None)


def collect_incidents(tl: list[tuple[float, Event]], base: int) -> tuple[dict[int, IncidentEvidence], list[Fault]]:
    """From the ordered timeline: each incident after generation ``base`` by its new generation, and every fault."""
    incs: dict[int, IncidentEvidence] = {}
    faults: list[Fault] = []

    def inc(n: int) -> IncidentEvidence:
        return incs.setdefault(n, IncidentEvidence(n))

    for t, e in tl:
        a = e.attrs
        if e.kind is K.FAULT_INJECTED:
            faults.append(_fault(t, e))
        elif e.kind is K.FAILURE_DETECTED:
            i = inc(e.generation + 1)
            if e.rank not in i.detect:  # a rank's first detection of this generation's failure
                i.detect[e.rank] = t
                i.marks.append((e.rank, "detection", t))
            fault_t = attr_number(a.get("fault_t"))
            if fault_t is not None:  # a monotonic fault time from the detector: same offset as its event
                faults.append(Fault(fault_t + (t - e.t_monotonic), "fault", "-" if e.rank is None else str(e.rank),
                                    None))
        elif e.kind is K.INCIDENT_OPENED:
            ag = a.get("generation")
            failed = min(e.generation, ag) if isinstance(ag, int) and not isinstance(ag, bool) else e.generation
            if failed + 1 <= base:
                continue
            i = inc(failed + 1)
            i.opened.append(t)
            i.lost.update(_lost(a.get("lost")))
            i.marks.append((None, "incident opened", t))
        elif e.kind is K.REPLACEMENT_WAITING:  # the incident's time from here to its plan: waiting for a node
            ag = a.get("generation")
            failed = min(e.generation, ag) if isinstance(ag, int) and not isinstance(ag, bool) else e.generation
            if failed + 1 > base:
                i = inc(failed + 1)
                i.any_t.append(t)
                i.marks.append((None, "waiting for a replacement", t))
        elif e.kind is K.PLAN_PUBLISHED:
            ag = a.get("generation")
            new = max(e.generation, ag) if isinstance(ag, int) and not isinstance(ag, bool) else e.generation
            if new <= base:
                continue
            i = inc(new)
            i.any_t.append(t)
            i.marks.append((None, "plan published", t))
            i.decision = str(a.get("decision")) if a.get("decision") is not None else i.decision
            i.lost.update(_lost(a.get("lost")))
            r = attr_number(a.get("resume_step", a.get("resume")))
            if r is not None:
                i.resume.append(int(r))
        elif e.generation > base:
            i = inc(e.generation)
            i.any_t.append(t)
            if e.kind in (K.GROUPS_REFORMED, K.TRANSFER_DONE, K.DISK_RESTORE, K.ROLLBACK_DONE):
                name = next(p for p, k in PHASE_KIND.items() if k is e.kind)
                i.phase.setdefault(name, []).append(t)
                i.marks.append((e.rank, name, t))
                if e.rank is not None and e.kind in (K.ROLLBACK_DONE, K.TRANSFER_DONE):
                    i.restored.setdefault(e.rank, {}).update(
                        {k: v for k, v in a.items() if k in ("source", "bytes", "replica_bytes")})
                if e.kind is K.ROLLBACK_DONE and e.step is not None:
                    i.resume.append(e.step)
                if e.kind is K.DISK_RESTORE and e.step is not None:
                    i.disk_step.append(e.step)
                    i.decision = i.decision or "disk"
            elif e.kind is K.FIRST_STEP_AFTER_RECOVERY:
                i.first.append(t)
                i.marks.append((e.rank, "first_step", t))
            elif e.kind is K.REPROTECT_DONE:
                i.reprotect.append(t)
                i.marks.append((e.rank, "reprotection", t))
            elif e.kind is K.JOB_START and e.rank is not None and a.get("role", "member") != "member":
                i.replaced.add(e.rank)
                i.marks.append((e.rank, "joined", t))
    return incs, faults


def restore_summary(restored: Mapping[int, Mapping[str, AttrValue]]) -> str:
    """Which tier served each rank's state, ranks grouped: ``1: holders 14.8 KiB + live replicas 4.0 MiB;
    0, 2, 3: own memory``. Pure; "" when no rank said."""
    names = {"local": "own memory", "node-local": "node-local copy", "peers": "holders", "disk": "disk snapshot",
             "initial": "initial state"}
    groups: dict[str, list[int]] = {}
    for rank in sorted(restored):
        r = restored[rank]
        source = str(r.get("source", "?"))
        label = names.get(source, source)
        total, replicas = attr_number(r.get("bytes")) or 0.0, attr_number(r.get("replica_bytes")) or 0.0
        if source == "peers":
            label = f"holders {_size(total - replicas)}" + (f" + live replicas {_size(replicas)}" if replicas else "")
        groups.setdefault(label, []).append(rank)
    return "; ".join(f"{', '.join(map(str, ranks))}: {label}" for label, ranks in groups.items())


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def assign_faults(incs: list[IncidentEvidence], faults: list[Fault]) -> list[Fault]:
    """Give each fault to the first incident signalled after it (and after the previous one's signal).

    A fault whose target rank is known not to be lost in that incident (a slowed
    worker, an etcd restart) is left unmatched and listed as such.
    """
    left = sorted(faults, key=lambda f: f.t)
    unmatched: list[Fault] = []
    prev = -math.inf
    for i in incs:
        sig = i.signal()
        if sig is None:
            continue
        lost = i.lost or i.replaced
        for f in [f for f in left if prev < f.t <= sig]:
            left.remove(f)
            (i.faults if f.rank is None or not lost or f.rank in lost else unmatched).append(f)
        prev = sig
    return unmatched + left


@dataclass
class IncidentBounds:
    """An incident's merged boundaries while they are being clamped."""

    inc: IncidentEvidence
    started: float
    source: str
    bounds: dict[str, float]
    resumed: float | None
    interrupted: bool = False


def incident_bounds(i: IncidentEvidence, job_start: float) -> IncidentBounds:
    """Start = earliest fault/leader/rank signal; each phase ends at its last rank, never before the last phase."""
    sig = i.signal()
    assert sig is not None  # every IncidentEvidence was created by an event with a time
    cands = [(f.t, f"{f.kind} injected") for f in i.faults] + [(t, "leader opened the incident") for t in i.opened]
    cands += [(t, "failure detected" if r is None else f"rank {r} detected the failure") for r, t in i.detect.items()]
    started, source = min(cands) if cands else (sig, "first event of the new generation (no detection signal)")
    started = max(started, job_start)
    cur = max([*i.detect.values(), *i.opened, started])
    bounds = {"detection": cur}
    for name in ("reformation", "transfer", "disk_restore", "rollback"):
        if i.phase.get(name):
            cur = max(cur, *i.phase[name])
            bounds[name] = cur
    resumed = max(cur, *i.first) if i.first else None
    return IncidentBounds(i, started, source, bounds, resumed)


def clamp_in_order(views: list[IncidentBounds]) -> None:
    """A later incident can only start after an earlier one; one that had not resumed when the next
    started was interrupted: the rest of its time belongs to the next."""
    for prev, nxt in zip(views, views[1:]):
        if nxt.started < prev.started:
            nxt.started = prev.started
            nxt.bounds = {k: max(v, nxt.started) for k, v in nxt.bounds.items()}
            nxt.resumed = None if nxt.resumed is None else max(nxt.resumed, nxt.started)
        if prev.resumed is None or prev.resumed > nxt.started:  # interrupted: the rest belongs to the next
            prev.resumed, prev.interrupted = None, True
            prev.bounds = {k: v for k, v in prev.bounds.items() if v <= nxt.started}
