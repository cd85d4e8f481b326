"""ckptless.goodput: an append-only event ledger and pure goodput accounting.

Nothing here reads a clock or a file system: callers append :class:`Event`
records stamped with their own clocks; :func:`account` turns one rank's view
into productive time and badput by cause, :func:`analyze` merges every
rank's view into the job's (per incident, phases ending at the last rank),
and :mod:`ckptless.goodput.compare` puts restart-from-disk beside it.
"""

from ckptless.goodput.accounting import (
    BADPUT,
    Category,
    GoodputReport,
    Incident,
    StepTime,
    account,
    render_report,
)
from ckptless.goodput.compare import BaselineComparison, Estimate, EstimateInputs, default_inputs, estimate
from ckptless.goodput.ledger import AttrValue, Event, EventKind, Ledger, LedgerFormatError
from ckptless.goodput.merge import (
    CATEGORIES, GOOGLE, PHASES, Fault, IncidentView, JobAnalysis, RankTrack, analyze, BADPUT_CATEGORIES)

__all__ = [
    "BADPUT", "Category", "GoodputReport", "Incident", "StepTime", "account", "render_report",
    "BaselineComparison", "Estimate", "EstimateInputs", "default_inputs", "estimate",
    "AttrValue", "Event", "EventKind", "Ledger", "LedgerFormatError",
    "CATEGORIES", "GOOGLE", "PHASES", "Fault", "IncidentView", "JobAnalysis", "RankTrack", "analyze",
    "BADPUT_CATEGORIES",
]
