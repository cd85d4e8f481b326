"""A rank's goodput events, appended to ``<goodput-dir>/rank<R>.jsonl`` as they happen.

Why one file per rank and flush per event: a rank may be SIGKILLed at any
moment; what it had recorded must already be on disk, and ranks never share a
file handle. ``ckptless report <dir>`` merges the files.
"""

from __future__ import annotations

import os
import time
from typing import IO

from ckptless.goodput.ledger import AttrValue, Event, EventKind


class WorkerLedger:
    def __init__(self, directory: str | None, rank: int) -> None:
        self.rank = rank
        self._file: IO[str] | None = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, f"rank{rank}.jsonl"), "a", buffering=1)

    def emit(
        self,
        kind: EventKind,
        step: int | None = None,
        generation: int = 0,
        t: float | None = None,
        job_level: bool = False,
        **attrs: AttrValue,
    ) -> Event:
        event = Event(kind, time.monotonic() if t is None else t, None if job_level else self.rank, generation, step, attrs)
        if self._file is not None:
            self._file.write(event.to_json() + "\n")
        return event

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
