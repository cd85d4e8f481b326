"""The event loop's bookkeeping: a simulated clock, the job's progress and where every second went (pure).

Why a ledger of seconds: as in :mod:`ckptless.goodput.accounting`, every simulated second
lands in exactly one category, so the categories sum to the duration and goodput is
``productive / duration``. *Productive* is useful work at the bare step's speed (a step the
job keeps, at the speed it would run without ckptless): mirroring's cost, saves, every
recovery phase, the work a rollback throws away (``lost_work``) and the throughput given up
while training on fewer ranks (``degraded``) are badput.

The clock is simulated: nothing sleeps. :class:`Timeline` is what a policy drives: it trains
(:meth:`Timeline.train_until`) at a speed and a per-unit-of-work overhead, is down for a list
of phases (:meth:`Timeline.go_down`), and refunds the unspent tail of a recovery that a
further failure cut short (:meth:`Timeline.interrupt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = ("productive", "startup", "mirror", "checkpoint_save", "detection", "replacement_wait", "restart", "reformation",
              "transfer", "rollback", "disk_restore", "reprotection", "lost_work", "degraded", "step_quorum")


@dataclass
class Timeline:
    """One system's job on the simulated clock."""

    step_s: float
    t: float = 0.0                       # accounted up to here
    down_until: float = 0.0              # > t: the job is down (recovering) until then
    down_parts: list[tuple[str, float, float]] = field(default_factory=list)  # (category, start, end) not yet spent
    progress: float = 0.0                # kept useful work, bare seconds
    resume_point: float = 0.0            # progress at the last resume (a committed version)
    seconds: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CATEGORIES})
    incidents: int = 0
    lost_work_s: float = 0.0

    @property
    def down(self) -> bool:
        return self.down_until > self.t

    def spend_down(self, until: float) -> None:
        """Account the recovery phases that lie before ``until``."""
        keep = []
        for cat, a, b in self.down_parts:
            if b <= until:
                self.seconds[cat] += b - a
            elif a < until:
                self.seconds[cat] += until - a
                keep.append((cat, until, b))
            else:
                keep.append((cat, a, b))
        self.down_parts = keep
        self.t = max(self.t, min(until, self.down_until))

    def train_until(self, until: float, *, speed: float = 1.0, overheads: dict[str, float] | None = None) -> float:
        """Train from ``t`` to ``until``: ``speed`` = share of full throughput (fewer ranks, fewer
        replica groups); ``overheads`` = extra wall seconds per second of work, by category (a
        mirror block / N steps, a save / its interval). Returns the work done."""
        if self.down:
            self.spend_down(until)
            if self.down_until > until:
                return 0.0
        wall = until - self.t
        if wall <= 0:
            return 0.0
        ovh = overheads or {}
        per_work = (1.0 / speed + sum(ovh.values())) if speed > 0 else float("inf")
        work = wall / per_work  # a unit of work takes 1 / speed + the overheads wall seconds
        extra = 0.0
        for cat, o in ovh.items():
            self.seconds[cat] += work * o
            extra += work * o
        self.seconds["productive"] += work
        self.seconds["degraded"] += max(0.0, wall - work - extra)
        self.progress += work
        self.t = until
        return work

    def lose(self, back_to: float) -> float:
        """Roll progress back to ``back_to`` (a committed version): that work counts as lost."""
        lost = max(0.0, self.progress - back_to)
        self.progress -= lost
        self.seconds["productive"] -= lost
        self.seconds["lost_work"] += lost
        self.lost_work_s += lost
        return lost

    def interrupt(self, now: float) -> list[tuple[str, float]]:
        """A failure during a recovery: the recovery starts over. Returns its unspent tail, which
        :meth:`go_down` still pays where the new recovery would end sooner (a wait for the
        scheduler's node is not cut short by a crash during it)."""
        self.spend_down(now)
        tail = [(cat, b - max(a, now)) for cat, a, b in self.down_parts if b > now]
        self.down_parts = []
        self.down_until = now
        self.t = now
        return tail

    def go_down(self, now: float, parts: list[tuple[str, float]], *, incident: bool = True,
                tail: list[tuple[str, float]] | None = None) -> float:
        """The job is down from ``now`` for ``parts`` in order (then what ``tail``, an interrupted
        recovery's unspent part, holds beyond them); returns when it resumes."""
        parts = list(parts)
        extra = sum(s for _, s in tail or []) - sum(s for _, s in parts)
        kept: list[tuple[str, float]] = []
        for cat, s in reversed(tail or []):  # the old recovery's last ``extra`` seconds, in its categories
            if extra <= 0:
                break
            kept.append((cat, min(s, extra)))
            extra -= s
        parts.extend(reversed(kept))
        t = now
        for cat, s in parts:
            if s > 0:
                self.down_parts.append((cat, t, t + s))
                t += s
        self.down_until = t
        self.t = now
        self.incidents += int(incident)
        return t

    def finish(self, end: float) -> None:
        """The run ends at ``end`` while down: the rest of the recovery is not paid."""
        if self.down:
            self.spend_down(end)
            self.down_parts = []
            self.down_until = min(self.down_until, end)


def committed_point(progress: float, resume_point: float, every_work: float, lag_work: float) -> float:
    """The newest version a rollback can resume from: versions every ``every_work`` of progress,
    each usable ``lag_work`` after it is reached (its round must commit), never older than the
    resume point (the version the job resumed from is committed)."""
    if every_work <= 0:
        return resume_point
    usable = max(0.0, progress - lag_work)
    return max(resume_point, (usable // every_work) * every_work)
