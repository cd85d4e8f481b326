"""Goodput ledger and accounting: exact worked examples plus properties over
arbitrary event sequences (categories partition the wall time)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.errors import ConfigError
from ckptless.goodput import (
    BADPUT,
    Category,
    Event,
    EventKind,
    Ledger,
    LedgerFormatError,
    account,
    render_report,
)

K = EventKind


def ev(kind: EventKind, t: float, step: int | None = None, rank: int | None = 0, gen: int = 0,
       **attrs: float) -> Event:
    return Event(kind, t, rank, gen, step, attrs)


def one_incident() -> Ledger:
    """Steps 1-5 take 1 s each; fault at 5.5, detected 5.6; resume from 3."""
    es = [ev(K.JOB_START, 0.0, rank=None)]
    es += [ev(K.STEP_DONE, float(s), s) for s in range(1, 6)]
    es += [ev(K.SNAPSHOT_SAVED, 5.2, 5),
           ev(K.FAILURE_DETECTED, 5.6, rank=None, fault_t=5.5),
           ev(K.GROUPS_REFORMED, 5.8, rank=None, gen=1),
           ev(K.TRANSFER_DONE, 6.3, gen=1),
           ev(K.ROLLBACK_DONE, 6.4, 3, gen=1),
           ev(K.FIRST_STEP_AFTER_RECOVERY, 7.4, 4, gen=1),
           ev(K.STEP_DONE, 8.4, 5, gen=1),
           ev(K.JOB_END, 9.0, rank=None, gen=1)]
    return Ledger(es)


def test_worked_example() -> None:
    rep = account(one_incident())
    s = rep.seconds
    assert rep.wall_s == 9.0
    # productive: steps 1-3 (3 s) + recomputed 4, 5 (2 s); steps 4, 5 first time are lost
    assert s[Category.PRODUCTIVE] == pytest.approx(5.0)
    assert s[Category.ROLLBACK] == pytest.approx(2.0 + 0.5 + 0.1)  # lost steps + partial + phase
    assert s[Category.DETECTION] == pytest.approx(0.1)
    assert s[Category.REFORMATION] == pytest.approx(0.2)
    assert s[Category.TRANSFER] == pytest.approx(0.5)
    assert s[Category.IDLE] == pytest.approx(0.6)
    assert math.fsum(s.values()) == pytest.approx(rep.wall_s)
    assert rep.goodput == pytest.approx(5 / 9)
    assert rep.steps_lost == 2 and rep.steps_done == 5
    (inc,) = rep.incidents
    assert inc.resume_step == 3 and inc.steps_lost == 2 and not inc.interrupted and not inc.from_disk
    assert inc.lost_work_s == pytest.approx(2.5)
    assert inc.downtime_s == pytest.approx(0.1 + 0.2 + 0.5 + 0.1 + 1.0)
    text = render_report(rep)
    assert "goodput 55.6%" in text and "reformation" in text and "resume" in text


def test_failure_during_recovery_and_disk() -> None:
    es = [ev(K.JOB_START, 0.0), ev(K.STEP_DONE, 1.0, 1), ev(K.STEP_DONE, 2.0, 2),
          ev(K.FAILURE_DETECTED, 2.5), ev(K.GROUPS_REFORMED, 3.0, gen=1),
          ev(K.FAILURE_DETECTED, 3.5, gen=1), ev(K.GROUPS_REFORMED, 4.0, gen=2),
          ev(K.DISK_RESTORE, 6.0, 0, gen=2), ev(K.FIRST_STEP_AFTER_RECOVERY, 7.0, 1, gen=2),
          ev(K.JOB_END, 7.0)]
    rep = account(Ledger(es))
    first, second = rep.incidents
    assert first.interrupted and not second.interrupted and second.from_disk
    assert second.resume_step == 0 and second.steps_lost == 2 and rep.steps_lost == 2
    assert rep.seconds[Category.DISK_RESTORE] == pytest.approx(2.0)
    assert rep.seconds[Category.PRODUCTIVE] == pytest.approx(1.0)
    assert math.fsum(rep.seconds.values()) == pytest.approx(7.0)


def test_other_ranks_are_ignored_and_empty_ledger() -> None:
    es = [ev(K.JOB_START, 0.0, rank=None), ev(K.STEP_DONE, 1.0, 1, rank=1), ev(K.JOB_END, 2.0, rank=None)]
    assert account(Ledger(es)).seconds[Category.IDLE] == 2.0
    assert account(Ledger(es), ref_rank=1).seconds[Category.PRODUCTIVE] == 1.0
    empty = account(Ledger())
    assert empty.goodput == 0.0 and empty.wall_s == 0.0


# --- properties --------------------------------------------------------------------
events_st = st.lists(st.tuples(st.sampled_from(list(EventKind)),  # includes the marker kinds
                               st.floats(0, 5, allow_nan=False),
                               st.sampled_from([None, 0, 1]),
                               st.one_of(st.none(), st.integers(0, 30)),
                               st.one_of(st.none(), st.floats(-1, 100, allow_nan=False)),
                               st.one_of(st.none(), st.floats(0, 1e10, allow_nan=False))),
                     max_size=40)


def build(raw: list[tuple[EventKind, float, int | None, int | None, float | None, float | None]]) -> Ledger:
    t = 0.0
    ledger = Ledger()
    for kind, dt, rank, step, fault, wall in raw:
        t += dt
        attrs = {} if fault is None else {"fault_t": fault}
        ledger.append(Event(kind, t, rank, 0, step, attrs, wall))
    return ledger


@settings(max_examples=300, deadline=None)
@given(events_st)
def test_categories_partition_wall_time(raw: list) -> None:
    rep = account(build(raw))
    assert all(v >= 0 for v in rep.seconds.values())
    assert set(rep.seconds) == set(Category) and set(rep.badput) == set(BADPUT)
    assert math.fsum(rep.seconds.values()) == pytest.approx(rep.wall_s, abs=1e-9)
    assert 0.0 <= rep.goodput <= 1.0
    assert rep.steps_lost >= 0 and rep.steps_done >= 0
    for inc in rep.incidents:
        assert all(v >= 0 for v in inc.phases.values())
        assert inc.first_step_s >= 0 and inc.lost_work_s >= 0 and inc.downtime_s >= 0
    assert render_report(rep).count("\n") >= 10


@settings(max_examples=150, deadline=None)
@given(events_st)
def test_jsonl_round_trip(raw: list) -> None:
    ledger = build(raw)
    again = Ledger.from_jsonl(ledger.to_jsonl())
    assert again.events == ledger.events
    assert account(again) == account(ledger)


def test_markers_are_not_boundaries() -> None:
    """The kinds added for the merged report change nothing in one rank's walk."""
    base = one_incident()
    extra = Ledger(sorted([*base, ev(K.FAULT_INJECTED, 5.5, rank=None, target=1),
                           ev(K.INCIDENT_OPENED, 5.65, rank=None), ev(K.PLAN_PUBLISHED, 5.7, rank=None, gen=1),
                           ev(K.REPROTECT_DONE, 7.9, gen=1, version=3)], key=lambda e: e.t_monotonic))
    a, b = account(base), account(extra)
    assert a.seconds == b.seconds and a.incidents == b.incidents


def test_t_wall_round_trip_and_old_lines() -> None:
    e = Event(K.STEP_DONE, 1.5, 0, 0, 1, {}, 1_790_000_000.25)
    assert Event.from_json(e.to_json()) == e and '"t_wall": 1790000000.25' in e.to_json()
    old = Event(K.STEP_DONE, 1.5, 0, 0, 1)
    assert "t_wall" not in old.to_json()  # written as before: old readers keep working
    assert Event.from_json(GOOD).t_wall is None
    assert Event.from_json(GOOD.replace('"attrs": {}', '"attrs": {}, "t_wall": null')).t_wall is None


def test_save_and_load(tmp_path) -> None:
    path = tmp_path / "ledger.jsonl"
    one_incident().save(path)
    assert Ledger.load(path).events == one_incident().events


GOOD = '{"kind": "step_done", "t_monotonic": 1.0, "rank": 0, "generation": 0, "step": 1, "attrs": {}}'


@pytest.mark.parametrize("line, field", [
    ("{not json", "line 2: json"),
    ("[1, 2]", "line 2: event"),
    ('{"t_monotonic": 1.0, "generation": 0}', "line 2: kind"),
    (GOOD.replace('"step_done"', '"exploded"'), "line 2: kind"),
    (GOOD.replace('"t_monotonic": 1.0', '"t_monotonic": "soon"'), "line 2: t_monotonic"),
    (GOOD.replace('"t_monotonic": 1.0', '"t_monotonic": 0.5'), "line 2: t_monotonic"),
    (GOOD.replace('"t_monotonic": 1.0', '"t_monotonic": -3'), "line 2: t_monotonic"),
    (GOOD.replace('"rank": 0', '"rank": 1.5'), "line 2: rank"),
    (GOOD.replace('"rank": 0', '"rank": -1'), "line 2: rank"),
    (GOOD.replace('"generation": 0', '"generation": true'), "line 2: generation"),
    (GOOD.replace('"step": 1', '"step": "x"'), "line 2: step"),
    (GOOD.replace('"attrs": {}', '"attrs": {"a": [1]}'), "line 2: attrs.a"),
    (GOOD.replace('"attrs": {}', '"attrs": 3'), "line 2: attrs"),
    (GOOD.replace('"attrs": {}', '"attrs": {}, "extra": 1'), "line 2: extra"),
    (GOOD.replace('"attrs": {}', '"attrs": {}, "t_wall": "noon"'), "line 2: t_wall"),
    (GOOD.replace('"attrs": {}', '"attrs": {}, "t_wall": -1'), "line 2: t_wall"),
])
def test_malformed_lines_name_line_and_field(line: str, field: str) -> None:
    text = GOOD + "\n" + line + "\n"
    with pytest.raises(LedgerFormatError) as exc:
        Ledger.from_jsonl(text)
    assert exc.value.field == field and exc.value.line == 2
    assert isinstance(exc.value, ConfigError)


def test_append_rejects_time_going_backwards() -> None:
    ledger = Ledger([ev(K.STEP_DONE, 2.0, 1)])
    with pytest.raises(LedgerFormatError, match="earlier than the previous"):
        ledger.append(ev(K.STEP_DONE, 1.0, 2))
    with pytest.raises(LedgerFormatError):
        Event(K.STEP_DONE, float("nan"))
