"""``ckptless`` command line: ``ckptless report <ledger.jsonl | goodput-dir> [--json]``.

Why a thin wrapper: all accounting lives in :mod:`ckptless.goodput` (pure,
tested there); the CLI only finds the ledger files, merges them, and turns
every expected failure (missing file, malformed line) into one line on
stderr and exit status 2, so scripts can rely on the status and humans do
not get a traceback for a typo in a path.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptless.errors import CkptlessError
from ckptless.goodput import Category, Event, GoodputReport, Ledger, account, render_report

EXIT_USAGE = 2


class _ReportError(Exception):
    """An expected failure: printed as one line, exit status 2."""


def load_ledgers(path: Path) -> Ledger:
    """One ledger from a file, or all ``*.jsonl`` files of a directory merged in time order.

    Merging sorts by monotonic timestamp (stable, so each file's order is
    kept on ties): the per-rank ledgers of one host share the monotonic clock.
    """
    if path.is_dir():
        files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if not files:
            raise _ReportError(f"{path}: no *.jsonl ledger files in this directory")
    elif path.exists():
        files = [path]
    else:
        raise _ReportError(f"{path}: no such file or directory")
    events: list[Event] = []
    for f in files:
        try:
            events.extend(Ledger.load(f))
        except CkptlessError as exc:
            raise _ReportError(f"{f}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise _ReportError(f"{f}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except OSError as exc:
            raise _ReportError(f"{f}: cannot read ({exc.strerror or exc})") from exc
    events.sort(key=lambda e: e.t_monotonic)
    return Ledger(events)


def report_to_json(rep: GoodputReport) -> dict[str, Any]:
    """The report as plain JSON types (categories by their string values)."""
    return {
        "start": rep.start,
        "end": rep.end,
        "wall_s": rep.wall_s,
        "goodput": rep.goodput,
        "productive_s": rep.productive_s,
        "seconds": {c.value: rep.seconds[c] for c in Category},
        "steps_done": rep.steps_done,
        "steps_lost": rep.steps_lost,
        "incidents": [
            {
                "index": i.index,
                "generation": i.generation,
                "detected_at": i.detected_at,
                "phases": {c.value: s for c, s in i.phases.items()},
                "first_step_s": i.first_step_s,
                "downtime_s": i.downtime_s,
                "lost_work_s": i.lost_work_s,
                "steps_lost": i.steps_lost,
                "resume_step": i.resume_step,
                "from_disk": i.from_disk,
                "interrupted": i.interrupted,
                "ended_at": i.ended_at,
            }
            for i in rep.incidents
        ],
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptless", description="ckptless command line tools")
    sub = p.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="goodput report from a run's ledger(s)",
                         description="Turn a run's goodput ledger into a report of productive time and badput.")
    rep.add_argument("path", type=Path, help="a ledger .jsonl file, or a directory whose *.jsonl files are merged")
    rep.add_argument("--json", action="store_true", help="print the report as JSON")
    rep.add_argument("--ref-rank", type=int, default=0,
                     help="rank whose events are accounted, besides job-level ones (default 0)")
    return p


def _report(args: argparse.Namespace) -> int:
    ledger = load_ledgers(args.path)
    if args.ref_rank < 0:
        raise _ReportError(f"invalid --ref-rank={args.ref_rank}: must be >= 0")
    rep = account(ledger, ref_rank=args.ref_rank)
    if args.json:
        sys.stdout.write(json.dumps(report_to_json(rep), indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(render_report(rep))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptless`` console script; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        if args.command == "report":
            return _report(args)
    except _ReportError as exc:
        print(f"ckptless {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. piped into `head`
        return 0
    return EXIT_USAGE  # pragma: no cover - argparse enforces a known command


if __name__ == "__main__":
    sys.exit(main())
