"""ckptless.recovery: decide (pure) and execute recovery after a failure.

``plan_recovery(facts)`` is the only decision point: a pure function from a
validated :class:`PlanningFacts` to one of :class:`RecoveryPlan`,
:class:`DiskFallback`, :class:`WaitForReplacement` or :class:`Unrecoverable`.
See docs/recovery.md for the rules.
"""

from ckptless.recovery.facts import (
    MAX_VERSIONS_PER_OWNER,
    PlanningFacts,
    PlanPolicy,
    RankSlot,
    ReplicaFact,
    Worker,
    WorkerReport,
)
from ckptless.recovery.plan import (
    Assignment,
    Decision,
    DiskFallback,
    RecoveryPlan,
    Rollback,
    Stripe,
    Transfer,
    Unrecoverable,
    WaitForReplacement,
    available_versions,
    plan_recovery,
    respawn_worker_id,
    resume_version,
    stripe_image,
)

__all__ = [
    "MAX_VERSIONS_PER_OWNER", "PlanningFacts", "PlanPolicy", "RankSlot", "ReplicaFact", "Worker",
    "WorkerReport", "Assignment", "Decision", "DiskFallback", "RecoveryPlan", "Rollback", "Stripe",
    "Transfer", "Unrecoverable", "WaitForReplacement", "available_versions", "plan_recovery",
    "respawn_worker_id", "resume_version", "stripe_image",
]
