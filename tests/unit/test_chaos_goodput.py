"""``ckptless-chaos goodput``'s pure parts: the seeded schedule, Young/Daly, goodput from events."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.chaos.goodput_plan import (
    TimedFault, draw_schedule, figures, load_schedule, render, save_seconds, young_daly_steps,
)
from ckptless.errors import ConfigError
from ckptless.goodput.ledger import Event, EventKind

K = EventKind


def test_schedule_is_a_function_of_its_inputs() -> None:
    a = draw_schedule(7, 30.0, 300.0, 4)
    assert a == draw_schedule(7, 30.0, 300.0, 4)
    assert a != draw_schedule(8, 30.0, 300.0, 4)
    assert all(isinstance(f, TimedFault) and f.kind == "kill_worker" for f in a)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), every=st.floats(0.5, 100.0), duration=st.floats(1.0, 1000.0),
       world=st.integers(1, 64))
def test_schedule_in_bounds_and_ordered(seed: int, every: float, duration: float, world: int) -> None:
    s = draw_schedule(seed, every, duration, world)
    assert [f.t for f in s] == sorted(f.t for f in s)
    assert all(0 <= f.t < duration and 0 <= f.rank < world for f in s)


def test_schedule_rate_is_the_mean_interval() -> None:
    """Exponential inter-arrival: over a long horizon the mean gap is every_s (within 5 %)."""
    s = draw_schedule(1, 30.0, 300_000.0, 4)
    gaps = [b.t - a.t for a, b in zip(s, s[1:])]
    assert statistics.fmean(gaps) == pytest.approx(30.0, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(30.0, rel=0.1)  # exponential: sd == mean
    assert {f.rank for f in s} == {0, 1, 2, 3}


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_schedule_refuses_a_bad_interval(bad: float) -> None:
    with pytest.raises(ConfigError):
        draw_schedule(0, bad, 100.0, 4)


def test_load_schedule(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"schedule": [{"t": 20, "rank": 1}, {"t": 5.5, "rank": 3, "kind": "kill_worker"}]}))
    assert load_schedule(p, 4, 60.0) == (TimedFault(5.5, 3), TimedFault(20.0, 1))
    for bad in ([{"t": 70, "rank": 0}], [{"t": 1, "rank": 4}], [{"t": 1, "rank": 0, "kind": "hang"}], {"x": 1}):
        p.write_text(json.dumps(bad))
        with pytest.raises(ConfigError):
            load_schedule(p, 4, 60.0)


def test_young_daly() -> None:
    # sqrt(2 x 1.5 s x 30 s) = 9.49 s of steps of 0.1 s -> 95 steps
    assert young_daly_steps(1.5, 30.0, 0.1) == 95
    assert young_daly_steps(0.001, 30.0, 10.0) == 1  # never below one step
    # the optimum grows with the square root of the MTBF
    assert young_daly_steps(1.0, 400.0, 0.01) == 4 * young_daly_steps(1.0, 25.0, 0.01)
    for bad in ((0.0, 30.0, 0.1), (1.0, -1.0, 0.1), (1.0, 30.0, math.nan)):
        with pytest.raises(ConfigError):
            young_daly_steps(*bad)


def _ev(what: EventKind, t: float, rank: int | None, gen: int = 0, step: int | None = None, **attrs: object) -> Event:
    return Event(what, t, rank, gen, step, attrs, t_wall=1000.0 + t)  # type: ignore[arg-type]


def _restarted_job() -> list[Event]:
    """Two ranks; steps 1-4 in generation 0 (1 s each), a kill at 5.5 s, a restart (generation 1)
    that restores the checkpoint of step 2 at 9 s, then steps 3-6: steps 3 and 4 were done twice."""
    evs = []
    for r in (0, 1):
        evs.append(_ev(K.JOB_START, 1.0, r))
        evs += [_ev(K.STEP_DONE, 1.0 + s, r, 0, s) for s in range(1, 5)]
        evs.append(_ev(K.JOB_START, 8.0, r, 1))
        evs.append(_ev(K.DISK_RESTORE, 9.0, r, 1, 2, steps_lost=2))
        evs += [_ev(K.FIRST_STEP_AFTER_RECOVERY if s == 3 else K.STEP_DONE, 7.0 + s, r, 1, s) for s in range(3, 7)]
    evs.append(_ev(K.FAULT_INJECTED, 5.5, None, 0, None, kind="kill_worker", target=1))
    return sorted(evs, key=lambda e: e.t_monotonic)


def test_figures_from_a_restarted_jobs_events() -> None:
    f = figures("torchrun", _restarted_job(), launch_wall=1000.0, stop_wall=1014.5, faults_injected=1)
    assert f.wall_s == pytest.approx(14.5)
    assert f.steps_kept == 6 and f.steps_lost == 2 and f.incidents == 1
    # every second of the wall is productive or one category of badput
    assert f.productive_s + sum(f.badput_s.values()) == pytest.approx(f.wall_s)
    assert f.badput_s["launch"] == pytest.approx(1.0) and f.badput_s["cut"] == pytest.approx(1.5)
    assert f.goodput == pytest.approx(f.productive_s / 14.5)
    assert f.productive_s <= 6.0 + 1e-9  # six kept steps of 1 s at most (the first one's warm-up is startup)
    assert f.downtime_s and f.downtime_s[0] == pytest.approx(10.0 - 5.5)  # the kill -> the last rank's first step
    assert "torchrun" in render([f])


def test_figures_without_events() -> None:
    f = figures("ckptless", [], 0.0, 10.0, "failed: x")
    assert f.goodput == 0.0 and f.badput_s == {"launch": 10.0} and f.ended == "failed: x"


def test_save_seconds() -> None:
    evs = [_ev(K.SNAPSHOT_SAVED, 2.0, 0, 0, 10), _ev(K.SNAPSHOT_SAVED, 4.0, 0, 0, 20), _ev(K.SNAPSHOT_SAVED, 2.0, 1, 0, 10)]
    assert save_seconds(evs, {10: 1002.5, 20: 1005.5}) == pytest.approx(1.0)  # median of 0.5 and 1.5
    assert save_seconds(evs, {}) is None
