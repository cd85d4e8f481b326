"""A rank's goodput events, appended to ``<goodput-dir>/rank<R>.jsonl`` as they happen.

Why one file per rank and flush per event: a rank may be SIGKILLed at any
moment; what it had recorded must already be on disk, and ranks never share a
file handle. ``ckptless report <dir>`` merges the files. Every event carries
both clocks: monotonic (phase durations on one host, never negative) and wall
(merging hosts, showing times of day). The coordinator leader writes its
job-level events (``incident_opened``, ``plan_published``) to ``leader.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import IO

from ckptless.goodput import AttrValue, Event, EventKind


class WorkerLedger:
    def __init__(self, directory: str | None, rank: int | None, name: str | None = None) -> None:
        self.directory = directory
        self.rank = rank
        self._name = name
        self._file: IO[str] | None = None
        self.last_step_before: int | None = None  # the newest step an earlier run of this rank finished
        self._open()

    def _open(self) -> None:
        if not self.directory or (self.rank is None and self._name is None):
            return
        os.makedirs(self.directory, exist_ok=True)
        name = self._name or f"rank{self.rank}"
        path = os.path.join(self.directory, f"{name}.jsonl")
        self.last_step_before = _last_step(path)
        self._file = open(path, "a", buffering=1)

    def set_rank(self, rank: int) -> None:
        """A spare learns its rank when it is assigned one: from then on it writes that rank's file."""
        if rank == self.rank and self._file is not None:
            return
        self.close()
        self.rank = rank
        self._open()

    def emit(
        self,
        kind: EventKind,
        step: int | None = None,
        generation: int = 0,
        t: float | None = None,
        job_level: bool = False,
        **attrs: AttrValue,
    ) -> Event:
        mono, wall = time.monotonic(), time.time()
        if t is not None:  # a given monotonic time: the wall time of that moment
            wall -= mono - t
            mono = t
        event = Event(kind, mono, None if job_level or self.rank is None else self.rank, generation, step, attrs,
                      t_wall=wall)
        if self._file is not None:
            try:
                self._file.write(event.to_json() + "\n")
            except (OSError, ValueError):
                pass  # a full disk must not stop training; the report says what is missing
        return event

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def leader_sink(directory: str | None) -> Callable[[str, dict[str, object]], None] | None:
    """Where the coordinator leader's job-level events go: ``<directory>/leader.jsonl`` (None: nowhere).

    The leader names what no rank's ledger can: which ranks an incident lost
    (a node loss leaves no survivor on that node to say it) and whether the
    plan resumed from memory or disk. ``ckptless report`` merges the file.
    """
    if not directory:
        return None
    ledger = WorkerLedger(directory, None, name="leader")

    def sink(kind: str, attrs: dict[str, object]) -> None:
        gen = attrs.get("generation")
        rest: dict[str, AttrValue] = {k: v for k, v in attrs.items()
                                      if k not in ("generation", "step", "t", "job_level") and isinstance(v, (str, int, float, bool))}
        ledger.emit(EventKind(kind), None, gen if isinstance(gen, int) else 0, None, True, **rest)

    return sink


def _last_step(path: str) -> int | None:
    """The newest finished step recorded in an existing ledger (a previous run of a restarted job)."""
    last = None
    try:
        with open(path) as f:
            for line in f:
                if '"step_done"' in line or '"first_step_after_recovery"' in line:
                    try:
                        step = json.loads(line).get("step")
                    except ValueError:
                        continue
                    if isinstance(step, int):
                        last = step if last is None else max(last, step)
    except OSError:
        return None
    return last
