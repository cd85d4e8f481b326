"""``ckptless`` command line: ``report`` (a finished or running job's ledgers) and ``status`` (live, from etcd).

    ckptless report RUN_DIR [--json] [--html FILE] [--baseline DIR] [--ckpt-every N ...]
    ckptless status --rdzv-endpoint HOST:PORT --rdzv-id ID [--json]
    ckptless simulate [--preset NAME] [--world W --nproc-per-node P --step-s T --state-mib S --mtbf-s M
                      --duration-s D --spares N ...] [--seed S] [--json FILE]

Why a thin wrapper: all accounting lives in :mod:`ckptless.goodput` (pure,
tested there) and all rendering in :mod:`ckptless.report`; the CLI parses
arguments and turns every expected failure (missing file, malformed line,
etcd unreachable) into one line on stderr and exit status 2, so scripts can
rely on the status and humans do not get a traceback for a typo in a path.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckptless.errors import CkptlessError
from ckptless.goodput import Category, Event, GoodputReport, Ledger, account, default_inputs, render_report
from ckptless.goodput import analyze
from ckptless.report import ReportInputError, load_run

EXIT_USAGE = 2
_ReportError = ReportInputError  # the name older callers catch


def load_ledgers(path: Path) -> Ledger:
    """One ledger from a file, or all ``*.jsonl`` files of a (goodput or run) directory merged in time order.

    Kept for one-rank views and older callers: merging by monotonic time is
    right only for ledgers of one host. The report itself merges on the wall
    clock (:func:`ckptless.goodput.analyze`).
    """
    events: list[Event] = list(load_run(path).events)
    events.sort(key=lambda e: e.t_monotonic)
    return Ledger(events)


def report_to_json(rep: GoodputReport) -> dict[str, Any]:
    """One rank's view (``--ref-rank``) as plain JSON types."""
    return {
        "view": "one rank", "start": rep.start, "end": rep.end, "wall_s": rep.wall_s, "goodput": rep.goodput,
        "productive_s": rep.productive_s, "seconds": {c.value: rep.seconds[c] for c in Category},
        "steps_done": rep.steps_done, "steps_lost": rep.steps_lost,
        "incidents": [
            {"index": i.index, "generation": i.generation, "detected_at": i.detected_at,
             "phases": {c.value: s for c, s in i.phases.items()}, "first_step_s": i.first_step_s,
             "downtime_s": i.downtime_s, "lost_work_s": i.lost_work_s, "steps_lost": i.steps_lost,
             "resume_step": i.resume_step, "from_disk": i.from_disk, "interrupted": i.interrupted,
             "ended_at": i.ended_at}
            for i in rep.incidents
        ],
    }


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptless", description="ckptless command line tools")
    sub = p.add_subparsers(dest="command", required=True)
    rep = sub.add_parser(
        "report", help="goodput report of a run (terminal, JSON, or an HTML page)",
        description="Merge a run's goodput ledgers (every rank, the leader, the fault injector) into one "
                    "report: goodput and badput by cause, each incident's phases, kill -> first step, and "
                    "what restart-from-disk would have cost.")
    rep.add_argument("path", type=Path, help="a ledger .jsonl file, a goodput dir, or a run dir containing goodput/")
    rep.add_argument("--json", action="store_true", help="print the report as JSON")
    rep.add_argument("--html", type=Path, metavar="FILE", help="also write one self-contained HTML page")
    rep.add_argument("--baseline", type=Path, metavar="DIR",
                     help="a baseline run's ledgers (restart-from-disk, or no faults) to compare with")
    rep.add_argument("--ref-rank", type=int, default=None,
                     help="account one rank's own view instead of the merged job (for debugging)")
    est = rep.add_argument_group("restart-from-disk estimate inputs (used when no --baseline has failures)")
    est.add_argument("--ckpt-every", type=_steps, metavar="STEPS",
                     help="checkpoint interval (default: the run's snapshot interval, else 500)")
    est.add_argument("--restart-s", type=_seconds, metavar="S", help="process restart cost (default 6.37)")
    est.add_argument("--load-s", type=_seconds, metavar="S", help="DCP load time (default 2.30)")
    est.add_argument("--save-s", type=_seconds, metavar="S", help="blocking save time (default 0.30)")
    st = sub.add_parser("status", help="live state of a running job, read from etcd",
                        description="Show a running job's members, spares, leader, generation and status, "
                                    "read-only from etcd.")
    st.add_argument("--rdzv-endpoint", required=True, help="etcd HOST:PORT (comma-separated for several)")
    st.add_argument("--rdzv-id", required=True, help="the job id (ckptless-run --rdzv-id)")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to reach etcd (default 5)")
    from ckptless.simulate import add_arguments
    add_arguments(sub.add_parser(
        "simulate", help="model a job's goodput under failures: ckptless vs restart-from-disk vs TorchFT-style",
        description="A seeded discrete-event model (docs/goodput.md): goodput, badput by category, lost work, the "
                    "chance a failure set defeats the mirrors' placement, and recommended K / spares / mirror_every "
                    "/ snapshot interval, for ckptless, restart-from-disk and dropping a replica group."))
    return p


def _simulate(args: argparse.Namespace) -> int:
    from ckptless.simulate import params_from
    from ckptless.simulate import build, render, to_json

    params, seed, seeds = params_from(args)
    rep = build(params, preset=args.preset, seed=seed, seeds=seeds, search=not args.no_recommend)
    sys.stdout.write(render(rep))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(to_json(rep), indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            raise ReportInputError(f"{args.json}: cannot write ({exc.strerror or exc})") from exc
    return 0


def _report(args: argparse.Namespace) -> int:
    if args.ref_rank is not None and args.ref_rank < 0:
        raise ReportInputError(f"invalid --ref-rank={args.ref_rank}: must be >= 0")
    if args.ref_rank is not None:
        rep = account(load_ledgers(args.path), ref_rank=args.ref_rank)
        out = json.dumps(report_to_json(rep), indent=2, sort_keys=True) + "\n" if args.json else render_report(rep)
        sys.stdout.write(out)
        return 0
    from ckptless.report import build_report
    from ckptless.report import report_to_json as full_json

    run = load_run(args.path)
    baseline = load_run(args.baseline) if args.baseline is not None else None
    inputs = default_inputs(analyze(run.events))
    for flag, name in (("ckpt_every", "interval_steps"), ("restart_s", "restart_s"), ("load_s", "load_s"),
                       ("save_s", "save_s")):
        if getattr(args, flag) is not None:
            inputs = replace(inputs, **{name: getattr(args, flag)})
            if flag == "ckpt_every":
                inputs = replace(inputs, interval_source="--ckpt-every")
            elif inputs.source.startswith("docs/"):
                inputs = replace(inputs, source="command line and " + inputs.source)
    report = build_report(run, baseline, inputs)
    if args.html is not None:
        from ckptless.report import write_html
        try:
            write_html(report, args.html)
        except OSError as exc:
            raise ReportInputError(f"{args.html}: cannot write ({exc.strerror or exc})") from exc
    if args.json:
        sys.stdout.write(json.dumps(full_json(report), indent=2, sort_keys=True) + "\n")
    else:
        from ckptless.report import render
        render(report, sys.stdout)
        if args.html is not None:
            print(f"wrote {args.html}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from ckptless.report import read_status, render_status, status_to_json

    st = read_status(args.rdzv_endpoint, args.rdzv_id, timeout_s=args.timeout)
    if args.json:
        sys.stdout.write(json.dumps(status_to_json(st), indent=2, sort_keys=True) + "\n")
    else:
        render_status(st, sys.stdout)
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
        if args.command == "status":
            return _status(args)
        if args.command == "simulate":
            return _simulate(args)
    except (ReportInputError, CkptlessError) as exc:
        print(f"ckptless {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. piped into `head`
        return 0
    return EXIT_USAGE  # pragma: no cover - argparse enforces a known command


if __name__ == "__main__":
    sys.exit(main())
