"""Seeded chaos schedules: deterministic, within bounds, never beyond the concurrency limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.chaos.faults import pause_spec
from ckptless.chaos.schedule import (
    RANK_KINDS, Fault, FaultKind, ScheduleConfig, explicit_schedule, holders, independent, make_schedule,
)
from ckptless.errors import ConfigError

configs = st.builds(
    lambda steps, faults, conc, gap, first, beyond: ScheduleConfig(
        steps=steps, faults=faults, max_concurrent=conc, min_gap=gap, first_step=first, allow_beyond_k=beyond,
        world_size=4, nproc_per_node=2, kinds=RANK_KINDS),
    st.integers(20, 60), st.integers(0, 5), st.integers(1, 2), st.integers(1, 3), st.integers(1, 4), st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(cfg=configs, seed=st.integers(0, 2**32))
def test_same_seed_same_schedule(cfg: ScheduleConfig, seed: int) -> None:
    assert make_schedule(cfg, seed) == make_schedule(cfg, seed)


@settings(max_examples=150, deadline=None)
@given(cfg=configs, seed=st.integers(0, 2**32))
def test_faults_within_bounds_and_concurrency(cfg: ScheduleConfig, seed: int) -> None:
    sched = make_schedule(cfg, seed)
    assert len(sched.faults) == cfg.faults
    steps = [f.step for f in sched.faults]
    assert steps == sorted(steps)
    hold = holders(cfg)
    for i, f in enumerate(sched.faults):
        assert cfg.first_step <= f.step < cfg.steps
        assert f.kind in cfg.kinds
        assert f.targets and all(0 <= t < cfg.world_size for t in f.targets)
        assert len(set(f.targets)) == len(f.targets)
        if i:
            assert f.step - sched.faults[i - 1].step >= cfg.min_gap
        if not cfg.allow_beyond_k:
            assert all(independent(a, b, hold) for a in f.targets for b in f.targets if a < b)
    for step in set(steps):
        assert len(sched.lost_at(step)) <= cfg.max_concurrent


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_node_kinds_lose_a_whole_node_within_the_limit(seed: int) -> None:
    cfg = ScheduleConfig(steps=20, faults=2, max_concurrent=2, spare_slots=2, min_gap=4,
                         kinds=(FaultKind.KILL_AGENT, FaultKind.KILL_LEADER, FaultKind.RESTART_ETCD))
    sched = make_schedule(cfg, seed)
    for f in sched.faults:
        lost = sched.lost_at(f.step)
        assert len(lost) <= cfg.max_concurrent
        if f.kind is FaultKind.KILL_AGENT:
            assert f.targets[0] // cfg.nproc_per_node != 0  # never the (initial) leader's node
        if f.kind is FaultKind.RESTART_ETCD:
            assert lost == set()


def test_different_seeds_differ_somewhere() -> None:
    cfg = ScheduleConfig(steps=40, faults=3, max_concurrent=2)
    assert len({make_schedule(cfg, s).faults for s in range(20)}) > 1


@pytest.mark.parametrize("field,kwargs", [
    ("steps", {"steps": 0}),
    ("world_size", {"world_size": 1}),
    ("nproc_per_node", {"nproc_per_node": 3}),
    ("replicas", {"replicas": 4}),
    ("max_concurrent", {"max_concurrent": 4}),
    ("faults", {"steps": 6, "faults": 4, "min_gap": 2}),
    ("kinds", {"kinds": ()}),
    ("spare_slots", {"kinds": (FaultKind.KILL_AGENT,), "max_concurrent": 2}),
    ("max_concurrent", {"kinds": (FaultKind.KILL_AGENT,), "spare_slots": 2}),
])
def test_invalid_configs_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        make_schedule(ScheduleConfig(**{"steps": 12, **kwargs}), 0)
    assert info.value.field == field


def test_negative_seed_rejected() -> None:
    with pytest.raises(ConfigError, match="seed"):
        make_schedule(ScheduleConfig(steps=12), -1)


def test_explicit_schedule_rejects_shared_group_unless_beyond_k() -> None:
    cfg = ScheduleConfig(steps=12, max_concurrent=2)
    holder = holders(cfg)[0][0]
    with pytest.raises(ConfigError) as info:
        explicit_schedule(cfg, [Fault(5, FaultKind.KILL_WORKER, (0, holder))])
    assert info.value.field == "targets"
    beyond = ScheduleConfig(steps=12, max_concurrent=2, allow_beyond_k=True)
    assert explicit_schedule(beyond, [Fault(5, FaultKind.KILL_WORKER, (0, holder))]).faults


def test_explicit_schedule_bounds() -> None:
    cfg = ScheduleConfig(steps=12)
    with pytest.raises(ConfigError, match="step"):
        explicit_schedule(cfg, [Fault(12, FaultKind.KILL_WORKER, (1,))])
    with pytest.raises(ConfigError, match="target"):
        explicit_schedule(cfg, [Fault(3, FaultKind.KILL_WORKER, (4,))])
    with pytest.raises(ConfigError, match="max_concurrent"):
        explicit_schedule(cfg, [Fault(3, FaultKind.KILL_WORKER, (1,)), Fault(3, FaultKind.HANG_WORKER, (3,))])


def test_pause_spec_one_pause_per_target() -> None:
    faults = (Fault(3, FaultKind.KILL_WORKER, (0, 2)), Fault(7, FaultKind.HANG_WORKER, (1,)))
    assert pause_spec(faults) == "f0r0:0:3,f0r2:2:3,f1r1:1:7"
