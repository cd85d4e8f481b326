"""The failure summary ``ckptless-run`` prints when a job fails, in torchrun's ChildFailedError shape.

Why torchrun's shape: people who run distributed jobs read that block first
(the root cause: which rank, exit code or signal, when, where, the traceback)
and scripts grep for it. Pure: it renders records, it reads nothing.
"""

from __future__ import annotations

import datetime
import signal
import textwrap
from collections.abc import Sequence

from ckptless.recovery import ExitRecord, JobStatus

RULE = "=" * 60
THIN = "-" * 60


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d_%H:%M:%S") if t > 0 else "<N/A>"


def _how(rec: ExitRecord) -> str:
    if rec.signal is not None:
        try:
            name = signal.Signals(rec.signal).name
        except ValueError:
            name = str(rec.signal)
        return f"-{rec.signal} (pid: {rec.pid})\n  error     : Signal {rec.signal} ({name}) received by PID {rec.pid}"
    return f"{rec.exitcode} (pid: {rec.pid})"


def _entry(i: int, rec: ExitRecord, local_rank: int | None) -> str:
    lr = "" if local_rank is None else f" (local_rank: {local_rank})"
    lines = [
        f"[{i}]:",
        f"  time      : {_when(rec.time)}",
        f"  host      : {rec.node_id}",
        f"  rank      : {rec.rank}{lr}",
        f"  exitcode  : {_how(rec)}",
    ]
    if rec.error is not None:
        lines.append(f"  error     : {rec.error.one_line()}")
        tb = rec.error.traceback.strip()
        if tb:
            body = textwrap.indent(tb, " " * 14).lstrip()
            lines.append(f"  traceback : {body}")
    elif rec.signal is None:
        lines.append("  traceback : <N/A> (the worker left no error record: see its output above)")
    return "\n".join(lines)


def render_failure(script: str, status: JobStatus, others: Sequence[ExitRecord] = (),
                   local_rank_of: dict[int, int] | None = None) -> str:
    """The block printed at the end of a failed job: the reason, then the root cause, then other failures."""
    lr = local_rank_of or {}
    out = [RULE, f"{script} FAILED", THIN, f"Reason: {status.reason}", THIN, "Failures:"]
    rest = [r for r in others if status.root_cause is None or r.rank != status.root_cause.rank]
    out.append("\n".join(_entry(i + 1, r, lr.get(r.rank)) for i, r in enumerate(rest)) if rest
               else "  <NO_OTHER_FAILURES>")
    out += [THIN, "Root Cause (first observed failure):"]
    if status.root_cause is not None:
        out.append(_entry(0, status.root_cause, lr.get(status.root_cause.rank)))
    else:
        out.append(f"[0]:\n  reason    : {status.reason}")
    out.append(RULE)
    return "\n".join(out)
