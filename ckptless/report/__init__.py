"""ckptless.report: a run's ledgers as a terminal report, JSON, or one self-contained HTML page.

The figures come from :mod:`ckptless.goodput` (pure); this package finds the
files (:mod:`.loader`), builds one :class:`~.model.Report` and renders it
(:mod:`.terminal`, :mod:`.html`). ``ckptless status`` (:mod:`.status`) is
the live counterpart, read from etcd.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptless import lazy
from ckptless.report.loader import LoadedRun, ReportInputError, ledger_files, load_run
from ckptless.report.model import Report, TimeFormat, build_report, report_to_json

__all__ = ["LoadedRun", "ReportInputError", "ledger_files", "load_run", "Report", "TimeFormat",
           "build_report", "report_to_json",
           "write_html", "read_status", "render_status", "status_to_json", "render"]


# Imported on first use (ckptless/lazy.py): an importer of one module pays for no other.
if TYPE_CHECKING:
    from ckptless.report.html import write_html
    from ckptless.report.status import read_status, render_status, status_to_json
    from ckptless.report.terminal import render

__getattr__ = lazy.exports(__name__, {
    "html": "write_html",
    "status": "read_status render_status status_to_json",
    "terminal": "render",
})
