"""ckptless.goodput: an append-only event ledger and pure goodput accounting.

Nothing here reads a clock: callers append :class:`Event` records stamped
with their own monotonic time, and :func:`account` turns a ledger into
productive time and badput by cause.
"""

from ckptless.goodput.accounting import BADPUT, Category, GoodputReport, Incident, account, render_report
from ckptless.goodput.ledger import AttrValue, Event, EventKind, Ledger, LedgerFormatError

__all__ = [
    "BADPUT", "Category", "GoodputReport", "Incident", "account", "render_report",
    "AttrValue", "Event", "EventKind", "Ledger", "LedgerFormatError",
]
