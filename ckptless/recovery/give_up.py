"""When the leader gives a job up: a failure that recurs before the job gets past it (pure).

The rule counts recoveries *in a row without progress*: each published plan carries ``stalled``, how many
recoveries before it resumed no later than it did; the plan that would make that count reach the limit
ends the job instead, naming the last failure. Without progress means a permanent partition, a fault
every formation hits, or a bug that fails the same step again; with progress between failures a job
never gives up, however many it sees: at scale failures are routine, and a lifetime count (what this
replaced) would have ended every long job. Found by the second GPU run (docs/gpu-runs/2026-11-28-h200/
session2/), where a bug made every generation fail at once: 38 recoveries at one step in 50 s.

The count lives in the published plan, so a new leader continues it. O(1) per incident.
"""

from __future__ import annotations

from ckptless.recovery.decision import DiskFallback, RecoveryPlan
from ckptless.recovery.view import JobView


def prior_of(view: JobView) -> tuple[int, int] | None:
    """The recovery in force, as (its resume version, its stalled count); None before the first."""
    d = None if view.membership is None else view.membership.decision
    return (d.resume_version, d.stalled) if isinstance(d, (RecoveryPlan, DiskFallback)) else None


def stalled(prior: tuple[int, int] | None, resume_version: int) -> int:
    """A new plan's count: one more than the plan in force if it resumes no later, else 0."""
    return prior[1] + 1 if prior is not None and resume_version <= prior[0] else 0


def reason(count: int, resume_version: int, limit: int, last_failure: str) -> str | None:
    """Why the job ends, or None while ``count`` is under ``limit``."""
    if count < limit:
        return None
    return (f"gave up after {count} recoveries in a row without progress (each resumed at version {resume_version} "
            f"or earlier; limit {limit}): failures keep recurring; the last: {last_failure[:300]}")
