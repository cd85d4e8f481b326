"""ckptless.report: a run's ledgers as a terminal report, JSON, or one self-contained HTML page.

The figures come from :mod:`ckptless.goodput` (pure); this package finds the
files (:mod:`.loader`), builds one :class:`~.model.Report` and renders it
(:mod:`.terminal`, :mod:`.html`). ``ckptless status`` (:mod:`.status`) is
the live counterpart, read from etcd.
"""

from ckptless.report.loader import LoadedRun, ReportInputError, ledger_files, load_run
from ckptless.report.model import Report, TimeFormat, build_report, report_to_json

__all__ = ["LoadedRun", "ReportInputError", "ledger_files", "load_run", "Report", "TimeFormat",
           "build_report", "report_to_json"]
