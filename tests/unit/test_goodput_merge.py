"""The job's merged view (every rank, the leader, the injector): hand-derived examples and properties.

The worked example is tests/harness/report_fixtures.py; its figures are derived there.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.goodput import CATEGORIES, Event, EventKind, EstimateInputs, analyze, estimate

from ..harness import report_fixtures as fx

K = EventKind
W = fx.WALL0


def approx(x: object) -> object:
    """Wall-clock seconds near 1.8e9 carry ~2e-7 s of float resolution."""
    return pytest.approx(x, abs=1e-5)


def test_kill_merged_by_hand() -> None:
    a = analyze(fx.all_events())
    assert a.clock == "wall" and a.clock_note == "" and a.world_size == 4
    (inc,) = a.incidents
    assert inc.started_at == approx(fx.FAULT + W) and "kill_worker" in inc.start_source
    assert [(f.kind, f.target, f.rank) for f in inc.faults] == [("kill_worker", "1", 1)]
    assert inc.lost_ranks == (1,) and inc.decision == "memory" and inc.resume_step == 10 and inc.steps_lost == 2
    assert inc.phases == approx({"detection": 0.07, "reformation": 0.86, "transfer": 0.47,
                                        "rollback": 0.02, "first_step": 0.40})
    assert inc.downtime_s == approx(1.82) and inc.kill_to_first_step_s == approx(1.82)
    assert inc.reprotect_s == approx(0.51) and not inc.interrupted
    assert [r for r, _ in inc.detected_by] == [2, 0, 3]  # rank 2 noticed first
    s = a.seconds
    assert s["startup"] == approx(1.3) and s["wasted_progress"] == approx(0.45)
    assert s["reprotection"] == approx(0.2)  # the first step took 0.4 s against a 0.2 s median
    assert s["productive"] == approx(3.983) and s["idle"] == approx(0.05)
    assert math.fsum(s.values()) == approx(a.wall_s) and a.wall_s == approx(7.403)
    assert a.median_step_s == approx(0.2) and a.steps_done == 20 and a.steps_lost == 2


def test_every_rank_file_tells_the_same_story() -> None:
    """The replacement's file and rank 0's no longer disagree: phases end at the last rank."""
    whole = analyze(fx.all_events())
    shuffled = fx.all_events()
    random.Random(7).shuffle(shuffled)
    assert analyze(shuffled) == whole  # file order and event order do not matter
    inc = whole.incidents[0]
    assert inc.ends["transfer"] == approx(fx.TRANSFER[1] + W)  # the replacement's transfer, not rank 0's
    assert {r for r, name, _ in inc.marks if name == "joined"} == {1}


def test_old_ledgers_fall_back_to_monotonic() -> None:
    evs = [e for r in range(4) for e in fx.rank_events(r, wall=False) if e.kind is not K.REPROTECT_DONE]
    a = analyze(evs)
    assert a.clock == "monotonic" and "monotonic" in a.clock_note and a.notes
    (inc,) = a.incidents
    assert inc.started_at == approx(fx.DETECT[2]) and inc.start_source == "rank 2 detected the failure"
    assert inc.phases["detection"] == approx(0.04) and inc.kill_to_first_step_s is None
    assert inc.downtime_s == approx(1.79) and inc.reprotected_at is None
    assert inc.lost_ranks == (1,)  # from the replacement's job_start (role spare)


def test_partly_wall_clock_and_several_hosts() -> None:
    evs = fx.all_events()
    # rank 3 lives on another host: its monotonic clock is 5000 s ahead; the wall clock agrees
    moved = [Event(e.kind, e.t_monotonic + 5000, e.rank, e.generation, e.step, e.attrs, e.t_wall)
             if e.rank == 3 else e for e in evs]
    assert analyze(moved).seconds == analyze(evs).seconds
    # rank 0 wrote no wall times: placed by the median offset, and the report says so
    mixed = [Event(e.kind, e.t_monotonic, e.rank, e.generation, e.step, e.attrs, None) if e.rank == 0 else e
             for e in evs]
    a = analyze(mixed)
    assert a.clock == "wall" and "no wall-clock time" in a.clock_note
    assert a.incidents[0].phases == approx(analyze(evs).incidents[0].phases)


def ev(what: EventKind, t: float, rank: int | None = 0, gen: int = 0, step: int | None = None, **attrs: object) -> Event:
    return Event(what, t, rank, gen, step, attrs, t + W)  # type: ignore[arg-type]


def steps(rank: int, first: int, last: int, t0: float, gen: int = 0, dt: float = 1.0) -> list[Event]:
    return [ev(K.STEP_DONE, t0 + (s - first) * dt, rank, gen, s) for s in range(first, last + 1)]


def test_failure_during_recovery_is_two_incidents() -> None:
    es = [ev(K.JOB_START, 0.0), *steps(0, 1, 3, 1.0), ev(K.FAILURE_DETECTED, 3.5),
          ev(K.GROUPS_REFORMED, 4.0, gen=1), ev(K.FAILURE_DETECTED, 4.5, gen=1),
          ev(K.GROUPS_REFORMED, 5.0, gen=2), ev(K.ROLLBACK_DONE, 5.2, gen=2, step=2),
          ev(K.FIRST_STEP_AFTER_RECOVERY, 6.2, gen=2, step=3), ev(K.JOB_END, 6.5, gen=2)]
    a = analyze(es)
    first, second = a.incidents
    assert first.interrupted and first.resumed_at is None and first.generation == 1
    assert second.generation == 2 and second.downtime_s == approx(1.7) and second.resume_step == 2
    assert math.fsum(a.seconds.values()) == approx(a.wall_s)


def test_disk_fallback_and_unmatched_fault() -> None:
    es = [ev(K.JOB_START, 0.0), *steps(0, 1, 4, 1.0),
          ev(K.FAULT_INJECTED, 2.2, None, kind="slow_worker", target=3),   # no incident follows it
          ev(K.FAULT_INJECTED, 4.2, None, kind="kill_node", target=1),
          ev(K.INCIDENT_OPENED, 4.4, None, lost="1,2", generation=0), ev(K.FAILURE_DETECTED, 4.5),
          ev(K.PLAN_PUBLISHED, 4.8, None, gen=1, decision="disk", resume_step=2),
          ev(K.GROUPS_REFORMED, 5.0, gen=1), ev(K.DISK_RESTORE, 6.0, gen=1, step=2),
          ev(K.FIRST_STEP_AFTER_RECOVERY, 7.0, gen=1, step=3), ev(K.JOB_END, 7.0, gen=1)]
    a = analyze(es)
    (inc,) = a.incidents
    assert inc.decision == "disk" and inc.lost_ranks == (1, 2) and inc.resume_step == 2
    assert inc.phases["disk_restore"] == approx(1.0) and inc.kill_to_first_step_s == approx(2.8)
    assert [f.kind for f in a.unmatched_faults] == ["slow_worker"]
    assert a.seconds["disk_restore"] == approx(1.0)


def test_reprotection_and_snapshot_rules() -> None:
    """Excess over the median step inside the window [resume, last reprotect_done] is badput; so is block_s."""
    base = [ev(K.JOB_START, 0.0), *steps(0, 1, 4, 1.0), ev(K.FAILURE_DETECTED, 4.5),
            ev(K.GROUPS_REFORMED, 5.0, gen=1), ev(K.ROLLBACK_DONE, 5.5, gen=1, step=4),
            ev(K.FIRST_STEP_AFTER_RECOVERY, 7.0, gen=1, step=5),        # 1.5 s: 0.5 s slowed
            ev(K.STEP_DONE, 8.3, gen=1, step=6), ev(K.STEP_DONE, 9.3, gen=1, step=7),   # 1.3 s, then normal
            ev(K.SNAPSHOT_SAVED, 9.0, gen=1, step=7, block_s=0.25), ev(K.JOB_END, 9.3, gen=1)]
    without = analyze(sorted(base, key=lambda e: e.t_monotonic))
    assert without.seconds["reprotection"] == approx(0.5)  # no marker: the first step only
    assert without.seconds["checkpoint_save"] == approx(0.25)
    marked = analyze(base + [ev(K.REPROTECT_DONE, 8.0, gen=1, version=4)])
    assert marked.seconds["reprotection"] == approx(0.5 + 0.3)
    assert marked.incidents[0].reprotect_s == approx(1.0)
    for a in (without, marked):
        assert math.fsum(a.seconds.values()) == approx(a.wall_s)


def test_estimate_from_inputs() -> None:
    a = analyze(fx.all_events())
    e = estimate(a, EstimateInputs(restart_s=5.0, load_s=2.0, save_s=0.5, interval_steps=5))
    (f,) = e.failures
    assert (f.fault_step, f.lost_steps) == (12, 2)       # last checkpoint at step 10: load it
    assert f.seconds == approx(5.0 + 2.0 + 1.3 + 2 * 0.2)
    assert e.saves == 4 and e.save_total_s == approx(2.0)
    assert e.wall_s == approx(a.wall_s - e.ckptless_failure_s + f.seconds + 2.0)
    assert e.saved_s == approx(e.wall_s - a.wall_s) and 0 < e.goodput < a.goodput


# --- properties over arbitrary multi-rank event soups -------------------------------------
soup = st.lists(st.tuples(st.sampled_from([None, 0, 1, 2]), st.sampled_from(list(EventKind)),
                          st.floats(0, 3, allow_nan=False), st.integers(0, 3),
                          st.one_of(st.none(), st.integers(0, 12)), st.booleans(),
                          st.sampled_from(["", "fault_t", "block_s", "lost"])),
                max_size=60)


def build(raw: list[tuple]) -> list[Event]:
    t, out = 0.0, []
    for rank, kind, dt, gen, step, wall, attr in raw:
        t += dt
        attrs: dict[str, object] = {}
        if attr == "fault_t":
            attrs["fault_t"] = max(0.0, t - dt / 2)
        elif attr == "block_s":
            attrs["block_s"] = dt / 3
        elif attr == "lost":
            attrs.update(lost="0,1", target=1, generation=gen)
        out.append(Event(kind, t, rank, gen, step, attrs, t + W if wall else None))  # type: ignore[arg-type]
    return out


@settings(max_examples=400, deadline=None)
@given(soup, st.randoms(use_true_random=False))
def test_merged_categories_partition_the_wall_time(raw: list, rnd: random.Random) -> None:
    evs = build(raw)
    a = analyze(evs)
    assert set(a.seconds) == set(CATEGORIES)
    assert all(v >= -1e-9 for v in a.seconds.values()), a.seconds
    assert math.fsum(a.seconds.values()) == pytest.approx(a.wall_s, abs=1e-6)
    assert 0.0 <= a.goodput <= 1.0 and a.steps_lost >= 0
    for inc in a.incidents:
        assert all(v >= -1e-9 for v in inc.phases.values()), inc.phases
        if inc.resumed_at is not None:
            assert math.fsum(inc.phases.values()) == pytest.approx(inc.downtime_s, abs=1e-6)
            assert inc.kill_to_first_step_s is None or inc.kill_to_first_step_s >= inc.downtime_s - 1e-6
    rnd.shuffle(evs)
    assert analyze(evs) == a
    e = estimate(a)
    assert all(0 <= f.lost_steps < e.inputs.interval_steps for f in e.failures) and e.wall_s >= 0


def test_the_incident_says_which_tier_served_each_rank() -> None:
    """Issue 21: a replaced rank's bytes from its holders and from live replicas, survivors from memory."""
    es = [ev(K.JOB_START, 0.0), ev(K.JOB_START, 0.0, 1), *steps(0, 1, 3, 1.0), ev(K.FAILURE_DETECTED, 3.5),
          ev(K.GROUPS_REFORMED, 4.0, gen=1), ev(K.GROUPS_REFORMED, 4.0, 1, gen=1),
          ev(K.TRANSFER_DONE, 4.5, 1, gen=1, bytes=(4 << 20) + 15104, replica_bytes=4 << 20),
          ev(K.ROLLBACK_DONE, 4.6, 1, gen=1, step=2, source="peers"),
          ev(K.TRANSFER_DONE, 4.1, 0, gen=1, bytes=0, replica_bytes=0),
          ev(K.ROLLBACK_DONE, 4.2, 0, gen=1, step=2, source="local"),
          ev(K.FIRST_STEP_AFTER_RECOVERY, 5.5, gen=1, step=3), ev(K.JOB_END, 6.0, gen=1)]
    (inc,) = analyze(sorted(es, key=lambda e: e.t_monotonic)).incidents
    assert inc.restored_from == "0: own memory; 1: holders 14.8 KiB + live replicas 4.0 MiB", inc.restored_from


def test_a_wait_for_a_replacement_node_is_its_own_badput() -> None:
    """Issue 22: from the leader's replacement_waiting to its plan, the job waited for a node; the rest
    of re-formation stays re-formation, and the categories still partition the wall time."""
    es = [ev(K.JOB_START, 0.0), ev(K.JOB_START, 0.0, 1), *steps(0, 1, 3, 1.0), ev(K.FAILURE_DETECTED, 3.5),
          ev(K.FAILURE_DETECTED, 3.5, 1), ev(K.INCIDENT_OPENED, 3.6, None, lost="2,3", generation=0),
          ev(K.REPLACEMENT_WAITING, 4.0, None, lost="2,3", generation=0),
          ev(K.PLAN_PUBLISHED, 24.0, None, gen=1, decision="memory", generation=1),
          ev(K.GROUPS_REFORMED, 25.0, gen=1), ev(K.GROUPS_REFORMED, 25.0, 1, gen=1),
          ev(K.ROLLBACK_DONE, 25.2, 0, gen=1, step=2, source="local"),
          ev(K.ROLLBACK_DONE, 25.2, 1, gen=1, step=2, source="local"),
          ev(K.FIRST_STEP_AFTER_RECOVERY, 26.0, gen=1, step=3), ev(K.JOB_END, 26.5, gen=1)]
    a = analyze(sorted(es, key=lambda e: e.t_monotonic))
    assert a.seconds["replacement_wait"] == pytest.approx(20.0, abs=1e-6)
    # Re-formation ran from the incident's opening (3.6) to the groups (25.0): 21.4 s, of which 20 s waited.
    assert a.seconds["reformation"] == pytest.approx(1.4, abs=1e-5)
    assert math.fsum(a.seconds.values()) == pytest.approx(a.end - a.start, abs=1e-6)
