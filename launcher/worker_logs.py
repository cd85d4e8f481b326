"""Where each worker's output goes: torchrun's log layout, and the tee that copies it to the console.

Why a module of its own: the layout is torchrun's contract
(``<log_dir>/<run_id>_XXXX/attempt_<n>/<local_rank>/{stdout,stderr}.log`` and
``error.json``, ``--redirects``/``--tee``/``--local-ranks-filter``), decided
before any process exists and kept when a spare is added later; the worker
group only opens the files it names and runs the tee pumps.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from ckptless.launcher.args import Std


@dataclass(frozen=True)
class WorkerLogs:
    """Where one worker's output goes (torchrun's --redirects/--tee/--local-ranks-filter)."""

    stdout: str | None = None  # a file (or os.devnull); None: the agent's console
    stderr: str | None = None
    tee_stdout: bool = False  # also copy the file's content to the console
    tee_stderr: bool = False
    error_file: str | None = None  # TORCHELASTIC_ERROR_FILE for worker_env()


def make_run_log_dir(log_dir: str | None, run_id: str) -> str:
    """``<log_dir>/<run_id>_XXXX``, like torchrun (a temp dir when log_dir is None)."""
    base = log_dir or tempfile.mkdtemp(prefix="ckptless_")
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)


def make_log_layout(run_log_dir: str, attempt: int, redirects: Sequence[Std], tee: Sequence[Std],
                    local_ranks_filter: frozenset[int] | None = None) -> list[WorkerLogs]:
    """Create ``attempt_<n>/<local_rank>/`` and say where each stream goes.

    Same rules as torchrun's DefaultLogsSpecs: a tee'd stream is also
    redirected; ranks outside the filter show nothing on the console.
    """
    out: list[WorkerLogs] = []
    for rank, (rd, tt) in enumerate(zip(redirects, tee)):
        d = os.path.join(run_log_dir, f"attempt_{attempt}", str(rank))
        os.makedirs(d, exist_ok=True)
        rd = Std(rd | tt)
        shown = local_ranks_filter is None or rank in local_ranks_filter
        hidden = None if shown else os.devnull
        out.append(WorkerLogs(
            stdout=os.path.join(d, "stdout.log") if rd & Std.OUT else hidden,
            stderr=os.path.join(d, "stderr.log") if rd & Std.ERR else hidden,
            tee_stdout=shown and bool(tt & Std.OUT), tee_stderr=shown and bool(tt & Std.ERR),
            error_file=os.path.join(d, "error.json"),
        ))
    return out


def logs_for(logs: WorkerLogs, template: int, local_rank: int) -> WorkerLogs:
    """``logs`` of local rank ``template``, moved to ``local_rank``'s own directory (files only)."""
    def move(path: str | None) -> str | None:
        if path is None or path == os.devnull or os.path.basename(os.path.dirname(path)) != str(template):
            return path
        d = os.path.join(os.path.dirname(os.path.dirname(path)), str(local_rank))
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, os.path.basename(path))

    return WorkerLogs(move(logs.stdout), move(logs.stderr), logs.tee_stdout, logs.tee_stderr, move(logs.error_file))


def pump(pipe: IO[bytes], fobj: IO[bytes], console_fd: int, header: bytes = b"") -> None:
    """Copy a worker's pipe into its log file (as is) and the agent's console, each console line
    prefixed with ``header`` (torchrun's ``[default0]:``), so interleaved ranks stay readable."""
    partial = b""
    try:
        while chunk := os.read(pipe.fileno(), 65536):
            fobj.write(chunk)
            fobj.flush()
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            if lines:
                os.write(console_fd, b"".join(header + ln + b"\n" for ln in lines))
        if partial:
            os.write(console_fd, header + partial + b"\n")
    except (OSError, ValueError):
        pass  # file closed at stop, or console gone: nothing left to copy to
    finally:
        pipe.close()
