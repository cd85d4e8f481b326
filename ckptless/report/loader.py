"""Find and read a run's ledger files (the only file I/O of the reports).

Why events and not one merged :class:`~ckptless.goodput.Ledger`: a ledger
refuses monotonic time going backwards, which is right inside one file but
wrong across files from several hosts (each host has its own monotonic
clock). The report merges the files itself, on the wall clock
(:func:`ckptless.goodput.analyze`).

A last line without its newline is a write cut short (a SIGKILLed rank) or
one still under way (a running job): it is skipped with a note, so a report
of a killed or live run still works. Any other malformed line is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptless.errors import CkptlessError
from ckptless.goodput import Event, Ledger


class ReportInputError(Exception):
    """An expected problem with the input (missing path, malformed line): one line for the user."""


@dataclass(frozen=True)
class LoadedRun:
    path: Path
    files: tuple[Path, ...]
    events: tuple[Event, ...]
    notes: tuple[str, ...] = ()


def ledger_files(path: Path) -> list[Path]:
    """A ledger file, the ``*.jsonl`` files of a goodput dir, or those of a run dir's ``goodput/``."""
    if path.is_dir():
        where = path / "goodput" if (path / "goodput").is_dir() else path  # a run dir has other *.jsonl files
        files = sorted(p for p in where.glob("*.jsonl") if p.is_file())
        if not files:
            raise ReportInputError(f"{where}: no *.jsonl ledger files in this directory")
        return files
    if path.exists():
        return [path]
    raise ReportInputError(f"{path}: no such file or directory")


def load_run(path: Path) -> LoadedRun:
    """Every event of every ledger file under ``path``, each file validated on its own."""
    files = ledger_files(path)
    events: list[Event] = []
    notes: list[str] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
            body, _, tail = text.rpartition("\n")
            if tail.strip():  # no newline after the last line: a write cut short (SIGKILL) or still under way
                try:
                    Event.from_json(tail)
                    body = text
                except CkptlessError:
                    notes.append(f"{f.name}: ignored an unfinished last line ({len(tail)} bytes, no newline)")
            events.extend(Ledger.from_jsonl(body))
        except CkptlessError as exc:
            raise ReportInputError(f"{f}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ReportInputError(f"{f}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except OSError as exc:
            raise ReportInputError(f"{f}: cannot read ({exc.strerror or exc})") from exc
    return LoadedRun(path, tuple(files), tuple(events), tuple(notes))
