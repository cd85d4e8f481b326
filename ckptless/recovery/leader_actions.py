"""What the leader machine asks its driver to do: the actions :func:`ckptless.recovery.leader_machine.step`
returns, each executed by :mod:`ckptless.recovery.leader` (etcd writes fenced on the leader's election key,
a plan built from facts, a log line, a resignation).

Why a module of its own: the machine's transitions and its vocabulary of outputs are read separately (a
reader of a transition needs only the names; a reader of the driver needs every field), and the machine
stays one concept under the size limit (tests/unit/test_structure.py). ``leader_machine`` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from ckptless.recovery.decision import DiskFallback, RecoveryPlan
from ckptless.recovery.view import JobStatus


@dataclass(frozen=True)
class OpenIncident:
    generation: int
    lost: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class RequestPlan:
    """Build facts from the last observed view with these ranks lost, plan, answer Planned/PlanFailed."""

    generation: int
    lost: frozenset[int]


@dataclass(frozen=True)
class Publish:
    """Bump the generation and write the decision's membership in one fenced transaction."""

    decision: RecoveryPlan | DiskFallback
    from_generation: int


@dataclass(frozen=True)
class EndJob:
    status: JobStatus


@dataclass(frozen=True)
class Log:
    level: Literal["info", "warning", "error"]
    message: str


@dataclass(frozen=True)
class Resign:
    reason: str


@dataclass(frozen=True)
class NoteWaiting:
    """Record on the incident that the job waits for a replacement (``ckptless status``, the ledger)."""

    generation: int
    lost: tuple[int, ...]
    deadline_in_s: float  # from now
    reason: str


@dataclass(frozen=True)
class AskGrow:
    """Ask a generation with fewer ranks to grow back: its processes leave together at a step boundary
    (the hosted ranks' state handed to images there) and the next plan gives those ranks to spares."""

    generation: int
    hosted: tuple[int, ...]


Action = Union[OpenIncident, RequestPlan, Publish, EndJob, Log, Resign, NoteWaiting, AskGrow]
