"""Append-only event ledger for goodput accounting.

Why events are passed in and never sampled here: the ledger must be a pure
record that can be replayed, merged and tested; whoever observes a phase
boundary (the job loop, the recovery executor, the agent) reads its own
clocks and appends an :class:`Event`. Two clocks, for two jobs: ordering
within one file uses the monotonic clock (must not go backwards: wall-clock
jumps would otherwise show up as negative recovery phases); ``t_wall``
(``time.time()`` read at the same moment) lets reports merge files from
several hosts and show the time of day. Ledgers written before ``t_wall``
existed still load; reports then fall back to monotonic time and say so.

On disk the ledger is JSON Lines, one event per line, parsed into typed
records; a malformed line is rejected with a :class:`LedgerFormatError`
naming the line number and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Union

from ckptless.errors import ConfigError

AttrValue = Union[str, int, float, bool, None]


class EventKind(str, Enum):
    """Phase boundaries of a job; see docs/recovery.md for who emits which."""

    JOB_START = "job_start"
    STEP_DONE = "step_done"
    FAILURE_DETECTED = "failure_detected"
    GROUPS_REFORMED = "groups_reformed"
    TRANSFER_DONE = "transfer_done"
    ROLLBACK_DONE = "rollback_done"
    FIRST_STEP_AFTER_RECOVERY = "first_step_after_recovery"
    SNAPSHOT_SAVED = "snapshot_saved"
    DISK_RESTORE = "disk_restore"
    JOB_END = "job_end"
    # A rank's background re-protection round of the resume version committed (marker).
    REPROTECT_DONE = "reprotect_done"
    # The chaos injector is about to send a fault; attrs: kind, target. Its time is the kill time.
    FAULT_INJECTED = "fault_injected"
    # The coordinator leader saw a generation fail (job-level); attrs: lost (ranks "1,3"), generation.
    INCIDENT_OPENED = "incident_opened"
    # The leader published a plan (job-level); attrs: decision memory/disk, generation, resume step.
    PLAN_PUBLISHED = "plan_published"
    # The leader found no replacement for lost ranks and waits for one (job-level); attrs: lost, generation.
    REPLACEMENT_WAITING = "replacement_waiting"
    # An agent measured the link its mirrors use (node-level marker); attrs: node, interface, address,
    # chosen_by, peer, bits_per_s (0: not measured), error.
    MIRROR_LINK = "mirror_link"
    # A survivor finished leaving a broken generation (marker, right before its report to the leader);
    # attrs: seconds (from its failure_detected: what leaving cost its training thread).
    GENERATION_LEFT = "generation_left"
    # A process adopted its first membership (marker, once per process); attrs: store_s (connecting the
    # generation's store), group_s (making the default group). A replacement's init() is on every survivor's
    # path (they wait for it at formation): issue 35 caught one taking 5 s with no record of where.
    MEMBERSHIP_ADOPTED = "membership_adopted"


class LedgerFormatError(ConfigError):
    """A ledger line (or event) is malformed; names the line and field."""

    def __init__(self, line: int | None, field: str, value: object, reason: str) -> None:
        self.line = line
        where = f"line {line}: {field}" if line is not None else field
        super().__init__(where, value, reason)


_FIELDS = ("kind", "t_monotonic", "rank", "generation", "step", "attrs", "t_wall")


@dataclass(frozen=True)
class Event:
    """One phase boundary: what happened, when (monotonic and wall seconds), where.

    ``t_wall`` is ``time.time()`` read together with ``t_monotonic`` (None in
    ledgers written before it existed). ``rank`` is None for job-level events (emitted by the leader/agent).
    ``step`` is the training step the event refers to: for ``step_done`` the
    step just finished; for ``rollback_done`` the version resumed from; for
    ``disk_restore`` the snapshot step restored.
    """

    kind: EventKind
    t_monotonic: float
    rank: int | None = None
    generation: int = 0
    step: int | None = None
    attrs: Mapping[str, AttrValue] = field(default_factory=dict)
    t_wall: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, EventKind):
            raise LedgerFormatError(None, "kind", self.kind, "not an EventKind")
        if not math.isfinite(self.t_monotonic) or self.t_monotonic < 0:
            raise LedgerFormatError(None, "t_monotonic", self.t_monotonic, "must be finite and >= 0")
        if self.rank is not None and self.rank < 0:
            raise LedgerFormatError(None, "rank", self.rank, "must be >= 0 or null")
        if self.generation < 0:
            raise LedgerFormatError(None, "generation", self.generation, "must be >= 0")
        if self.step is not None and self.step < 0:
            raise LedgerFormatError(None, "step", self.step, "must be >= 0 or null")
        if self.t_wall is not None and (not math.isfinite(self.t_wall) or self.t_wall < 0):
            raise LedgerFormatError(None, "t_wall", self.t_wall, "must be finite and >= 0, or null")

    def to_json(self) -> str:
        doc: dict[str, Any] = {"kind": self.kind.value, "t_monotonic": self.t_monotonic,
                               "rank": self.rank, "generation": self.generation, "step": self.step,
                               "attrs": dict(self.attrs)}
        if self.t_wall is not None:  # old readers (and old files) stay byte-compatible without it
            doc["t_wall"] = self.t_wall
        return json.dumps(doc, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str, line: int | None = None) -> Event:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LedgerFormatError(line, "json", text[:80], f"not valid JSON ({exc.msg})") from exc
        if not isinstance(raw, dict):
            raise LedgerFormatError(line, "event", type(raw).__name__, "must be a JSON object")
        unknown = set(raw) - set(_FIELDS)
        if unknown:
            raise LedgerFormatError(line, sorted(unknown)[0], raw[sorted(unknown)[0]], "unknown field")
        kind_name = _req(raw, "kind", str, line)
        try:
            kind = EventKind(kind_name)
        except ValueError as exc:
            raise LedgerFormatError(line, "kind", kind_name, "unknown event kind") from exc
        t = _req(raw, "t_monotonic", (int, float), line)
        t_wall = None if raw.get("t_wall") is None else float(_req(raw, "t_wall", (int, float), line))
        rank = _opt_int(raw, "rank", line)
        gen = _req(raw, "generation", int, line)
        step = _opt_int(raw, "step", line)
        attrs = raw.get("attrs", {})
        if not isinstance(attrs, dict):
            raise LedgerFormatError(line, "attrs", attrs, "must be an object")
        for key, val in attrs.items():
            if val is not None and not isinstance(val, (str, int, float, bool)):
                raise LedgerFormatError(line, f"attrs.{key}", val, "must be a scalar")
        try:
            return cls(kind, float(t), rank, gen, step, attrs, t_wall)
        except LedgerFormatError as exc:
            raise LedgerFormatError(line, exc.field, exc.value, exc.reason) from exc


def _req(raw: dict[str, Any], name: str, types: type | tuple[type, ...], line: int | None) -> Any:
    if name not in raw:
        raise LedgerFormatError(line, name, None, "missing")
    val = raw[name]
    if isinstance(val, bool) or not isinstance(val, types):
        raise LedgerFormatError(line, name, val, f"wrong type {type(val).__name__}")
    return val


def _opt_int(raw: dict[str, Any], name: str, line: int | None) -> int | None:
    val = raw.get(name)
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, int):
        raise LedgerFormatError(line, name, val, "must be an integer or null")
    return val


class Ledger:
    """Append-only, time-ordered sequence of events (the only mutable type here).

    Why it refuses out-of-order appends instead of sorting: a timestamp that
    goes backwards means two clock domains were mixed; accounting on such a
    ledger would be silently wrong.
    """

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self._events: list[Event] = []
        for ev in events:
            self.append(ev)

    def append(self, event: Event) -> None:
        if self._events and event.t_monotonic < self._events[-1].t_monotonic:
            raise LedgerFormatError(len(self._events) + 1, "t_monotonic", event.t_monotonic,
                                    f"earlier than the previous event ({self._events[-1].t_monotonic})")
        self._events.append(event)

    @property
    def events(self) -> tuple[Event, ...]:
        return tuple(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(tuple(self._events))

    def to_jsonl(self) -> str:
        return "".join(ev.to_json() + "\n" for ev in self._events)

    @classmethod
    def from_jsonl(cls, text: str) -> Ledger:
        """Parse JSON Lines; blank lines are skipped, line numbers are 1-based."""
        ledger = cls()
        for no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            ev = Event.from_json(line, no)
            try:
                ledger.append(ev)
            except LedgerFormatError as exc:
                raise LedgerFormatError(no, "t_monotonic", ev.t_monotonic, exc.reason) from exc
        return ledger

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_jsonl(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Ledger:
        return cls.from_jsonl(Path(path).read_text(encoding="utf-8"))
