"""ckptless.recovery: decide (pure) and execute recovery after a failure.

``plan_recovery(facts)`` is the only decision point: a pure function from a
validated :class:`PlanningFacts` to one of :class:`RecoveryPlan`,
:class:`DiskFallback`, :class:`WaitForReplacement` or :class:`Unrecoverable`.
See docs/recovery.md for the rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptless import lazy
from ckptless.recovery.facts import (
    MAX_VERSIONS_PER_OWNER,
    PlanningFacts,
    PlanPolicy,
    RankSlot,
    ReplicaFact,
    Worker,
    WorkerReport,
    NodeLocalCopy,
    NodeLocalImage,
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
    "RestoreInputs", "SnapshotLoadFailed", "adopt_copies", "apply_decision", "build_report", "restore_early",
    "NodeLocalCopy", "NodeLocalImage", "RecoveryLeader", "write_initial_membership", "LeaderConfig", "Received",
    "execute_transfers", "EXIT_KINDS", "ErrorSummary", "ExitKind", "ExitRecord", "JobStatus", "MAX_TRACEBACK_CHARS",
    "report_record_to_json", "Membership", "membership_from_json", "report_from_json", "spare_from_json",
    "spare_to_json",
]


# Imported on first use (ckptless/lazy.py): an importer of one module pays for no other.
if TYPE_CHECKING:
    from ckptless.recovery.executor import (
        RestoreInputs, SnapshotLoadFailed, adopt_copies, apply_decision, build_report, restore_early)
    from ckptless.recovery.leader import RecoveryLeader, write_initial_membership
    from ckptless.recovery.leader_machine import LeaderConfig
    from ckptless.recovery.transfer import Received, execute_transfers
    from ckptless.recovery.view import (
        EXIT_KINDS, ErrorSummary, ExitKind, ExitRecord, JobStatus, MAX_TRACEBACK_CHARS, report_record_to_json)
    from ckptless.recovery.wire import (
        Membership, membership_from_json, report_from_json, spare_from_json, spare_to_json)

__getattr__ = lazy.exports(__name__, {
    "executor": "RestoreInputs SnapshotLoadFailed adopt_copies apply_decision build_report restore_early",
    "leader": "RecoveryLeader write_initial_membership",
    "leader_machine": "LeaderConfig",
    "transfer": "Received execute_transfers",
    "view": "EXIT_KINDS ErrorSummary ExitKind ExitRecord JobStatus MAX_TRACEBACK_CHARS report_record_to_json",
    "wire": "Membership membership_from_json report_from_json spare_from_json spare_to_json",
})
