"""When the leader gives a job up: a failure that recurs before the job gets past it (pure).

The rule counts recoveries *in a row without progress*: each published plan carries ``stalled``, how many
recoveries before it resumed no later than it did; the plan that would make that count reach the limit
ends the job instead, naming the last failure. Without progress means a permanent partition, a fault
every formation hits, or a bug that fails the same step again; with progress between failures a job
never gives up, however many it sees: at scale failures are routine, and a lifetime count (what this
replaced) would have ended every long job. Found by the second GPU run (docs/gpu-runs/2026-11-28-h200/
session2/), where a bug made every generation fail at once: 38 recoveries at one step in 50 s.

The count lives in the published plan, so a new leader continues it. O(1) per incident.

A sharper rule for one cause (issue 38): an incident in which a rank's collective waited out its whole
timeout and no rank died or lost its node (:func:`timed_out`) is ranks that run different collectives
(a replacement in a framework's setup barrier, the survivors in a broadcast); after a resume that
repeats deterministically, each generation costing the collective timeout (90 s). Two such incidents
in a row at one resume version end the job at once with :class:`ckptless.errors.CollectivesDiverged`,
not 50 of them.
"""

from __future__ import annotations

from ckptless.recovery.decision import DiskFallback, RecoveryPlan
from ckptless.recovery.view import JobView


TIMEOUTS_LIMIT = 2  # timed-out incidents in a row at one resume version (CollectivesDiverged)


def prior_of(view: JobView) -> tuple[int, int, int] | None:
    """The recovery in force, as (its resume version, its stalled count, its timeouts count); None
    before the first."""
    d = None if view.membership is None else view.membership.decision
    return (d.resume_version, d.stalled, d.timeouts) if isinstance(d, (RecoveryPlan, DiskFallback)) else None


def timed_out(view: JobView) -> bool:
    """The incident is a collective timeout and nothing else: a rank reported one, none died."""
    return not view.faulted and any(r.timed_out for r in view.reports.values())


def timeouts(prior: tuple[int, int, int] | None, resume_version: int, now_timed_out: bool) -> int:
    """A new plan's count of timed-out incidents in a row resuming no later than the one before."""
    if not now_timed_out:
        return 0
    return prior[2] + 1 if prior is not None and resume_version <= prior[0] else 1


def diverged(count: int, resume_version: int, last_failure: str) -> str | None:
    """Why the job ends on collectives that diverge after a resume, or None below the limit."""
    if count < TIMEOUTS_LIMIT:
        return None
    return (f"CollectivesDiverged: {count} generations in a row ended by a collective timeout with no rank lost, "
            f"each resumed at version {resume_version}: after a resume the ranks run different collectives (a "
            "replacement and the survivors in different calls: a framework's setup that depends on state a "
            "survivor kept and a replacement rebuilt; docs/failure-model.md). Ending instead of looping; the "
            f"last: {last_failure[:300]}")


def stalled(prior: tuple[int, int, int] | None, resume_version: int) -> int:
    """A new plan's count: one more than the plan in force if it resumes no later, else 0."""
    return prior[1] + 1 if prior is not None and resume_version <= prior[0] else 0


def reason(count: int, resume_version: int, limit: int, last_failure: str) -> str | None:
    """Why the job ends, or None while ``count`` is under ``limit``."""
    if count < limit:
        return None
    return (f"gave up after {count} recoveries in a row without progress (each resumed at version {resume_version} "
            f"or earlier; limit {limit}): failures keep recurring; the last: {last_failure[:300]}")
