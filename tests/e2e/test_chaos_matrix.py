"""The chaos matrix: real agents, real workers, real signals, each run against its fault-free twin.

CI runs one bounded, seeded scenario (not marked slow): a hang and a kill of
different ranks at fixed steps on 2 nodes x 2 workers, plus its baseline --
two job runs, about 60-80 s on 2 cores. The full matrix (every scenario of
``ckptless-chaos list`` and more seeds) is ``@pytest.mark.slow``.

Partition scenarios (one network namespace per node, docs/chaos.md) need root
and run only with ``-m slow``; the ones that expose a known product gap are
``xfail`` (not strict) with the gap named, so a fix turns them into XPASS.
"""

from __future__ import annotations

import os

import pytest

from ckptless.chaos.catalogue import catalogue, long_scenario, partition_scenarios, random_scenario
from ckptless.chaos.cluster import ClusterSpec
from ckptless.chaos.faults import HOLD_BEFORE_END, pause_spec
from ckptless.chaos.scenario import BaselineCache, Scenario, render_fault_table, render_table, run_scenario
from ckptless.chaos.schedule import Fault, FaultKind, Schedule, ScheduleConfig, explicit_schedule
from ckptless.errors import ConfigError

PARTITIONS = sorted(sc.name for sc in partition_scenarios())
# Product gaps these scenarios expose (docs/chaos.md, "Findings"); not fixable in chaos/.
# partition-nodes and partition-workers-permanent pass since f8704f3 (store reconnect; the give-up
# names the last cause).
KNOWN_GAPS = {
    "partition-etcd-permanent": "the cut-off agent exits (1, with its message) only once its workers have "
                                "ended, and they give up reporting only after WorkerControl.outage_timeout_s "
                                "= 300 s: ~330 s after the cut, past the scenario's 150 s (node grace 3 s)",
}

CI_SEED = 5  # step 5: hang rank 3; step 10: kill rank 1 (asserted below, so a schedule change is caught)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> BaselineCache:
    return BaselineCache(tmp_path_factory.mktemp("chaos"))


def _check(sc: Scenario, baselines: BaselineCache) -> None:
    v = run_scenario(sc, baselines.root, baselines, log=lambda _line: None)
    assert v.passed, render_table([v])
    lost = {r for inj in v.injections for r in inj.lost}
    assert v.generation is not None and v.generation >= (1 if lost else 0)


@pytest.mark.timeout(240)
def test_ci_seeded_hang_then_kill(baselines: BaselineCache) -> None:
    sc = random_scenario(CI_SEED)
    kinds = [(f.step, f.kind, f.targets) for f in sc.schedule.faults]
    assert kinds == [(5, FaultKind.HANG_WORKER, (3,)), (10, FaultKind.KILL_WORKER, (1,))]
    _check(sc, baselines)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", sorted(set(catalogue()) - set(PARTITIONS)))
def test_matrix_scenario(name: str, baselines: BaselineCache) -> None:
    _check(catalogue()[name], baselines)


def _partition_param(name: str) -> object:
    marks = [pytest.mark.xfail(reason=KNOWN_GAPS[name], strict=False)] if name in KNOWN_GAPS else []
    return pytest.param(name, marks=marks)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize("name", [_partition_param(n) for n in PARTITIONS])
def test_partition_scenario(name: str, baselines: BaselineCache) -> None:
    """Survived bitwise equal, or (where the scenario allows it) ended naming the cause."""
    sc = catalogue()[name]
    v = run_scenario(sc, baselines.root, baselines, log=lambda _line: None)
    assert v.passed, render_table([v])
    if v.ended is None and sc.generation is not None:
        assert v.generation is not None and v.generation >= sc.generation[0]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("seed", [1, 7, 8])
def test_matrix_seeded(seed: int, baselines: BaselineCache) -> None:
    _check(random_scenario(seed), baselines)


def test_catalogue_is_valid_and_named_uniquely() -> None:
    cat = catalogue()
    assert {"kill-worker", "hang-worker", "node-loss", "leader-loss", "etcd-restart", "two-groups",
            "beyond-k-disk", "spare-any-refill"} <= set(cat)
    for sc in cat.values():
        assert sc.schedule.faults and sc.fault and sc.expected
        if any(f.kind is FaultKind.HANG_WORKER for f in sc.schedule.faults):
            assert sc.spec.hang_timeout, sc.name
        if any(f.kind.loses_node for f in sc.schedule.faults):
            assert sc.spec.spare_nodes * sc.spec.spares_per_spare_node >= sc.spec.nproc_per_node, sc.name
    assert cat["beyond-k-disk"].expect_disk and cat["beyond-k-disk"].spec.snapshot_every


def test_partition_scenarios_are_well_formed() -> None:
    """Fast: every partition scenario runs in namespaces, names its fault, bounds its generation."""
    assert {"partition-etcd-short", "partition-etcd-long", "partition-workers"} <= set(PARTITIONS)
    for sc in partition_scenarios():
        assert sc.spec.netns and sc.generation is not None, sc.name
        assert all(f.kind.is_partition and not f.kind.loses_ranks for f in sc.schedule.faults)
        assert sc.schedule.lost_at(sc.schedule.faults[0].step) == set()
    short = catalogue()["partition-etcd-short"]
    assert short.generation == (0, 0) and short.schedule.faults[0].duration_s is not None
    long = catalogue()["partition-etcd-long"]
    grace = long.spec.node_grace
    assert grace is not None and long.schedule.faults[0].duration_s is not None
    assert long.schedule.faults[0].duration_s > long.spec.lease_ttl + grace


def test_partition_schedule_validation_and_pauses() -> None:
    cfg = ScheduleConfig(steps=40, kinds=(FaultKind.PARTITION_WORKERS,))
    with pytest.raises(ConfigError, match="two different nodes"):
        explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_WORKERS, (0, 1), 3.0)])
    with pytest.raises(ConfigError, match="mode"):
        explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_WORKERS, (1, 2), 3.0, "flaky")])
    with pytest.raises(ConfigError, match="duration_s"):
        explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_NODE_ETCD, (2,), 0.0)])
    sched = explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_WORKERS, (1, 2), 3.0, "reset")])
    hold = 40 - HOLD_BEFORE_END
    assert pause_spec(sched.faults, 40, 4) == f"f0r1:1:5,f0r2:2:5,h0r0:0:{hold},h0r1:1:{hold},h0r2:2:{hold},h0r3:3:{hold}"
    assert pause_spec(sched.faults) == "f0r1:1:5,f0r2:2:5"


LONG_SEED = 1


def test_long_scenario_is_well_formed() -> None:
    """Fast: the long run has >= 20 faults of every kind, warm spares for both lost nodes, a watchdog
    for the hangs, whole-node kills, and its model agrees with the schedule."""
    sc = long_scenario(LONG_SEED)
    kinds = {f.kind for f in sc.schedule.faults}
    assert len(sc.schedule.faults) >= 20
    assert kinds == {FaultKind.KILL_WORKER, FaultKind.HANG_WORKER, FaultKind.KILL_AGENT, FaultKind.KILL_LEADER,
                     FaultKind.KILL_IN_RECOVERY}
    assert sc.spec.hang_timeout and sc.whole_node and sc.spec.spare_nodes == 1
    lost_nodes = sum(1 for f in sc.schedule.faults if f.kind.loses_node)
    assert sc.spec.spares_per_spare_node >= lost_nodes * sc.spec.nproc_per_node
    assert len(sc.schedule.expect) == len(sc.schedule.faults)
    assert sc.schedule.faults[-1].step < sc.spec.steps


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_long_run_ends_bitwise_equal(baselines: BaselineCache) -> None:
    """ONE job, >= 20 seeded faults (kills, hangs, two at once, a node loss, a leader loss, a kill while
    the leader holds before publishing a recovery): bitwise equal to the fault-free run (~5-10 min)."""
    sc = long_scenario(LONG_SEED)
    v = run_scenario(sc, baselines.root, baselines, log=lambda _line: None)
    assert v.passed, render_table([v]) + render_fault_table(v)
    assert len(v.injections) == len(sc.schedule.faults) >= 20
    in_recovery = [i for i in v.injections if i.fault.kind is FaultKind.KILL_IN_RECOVERY]
    assert in_recovery and all("held before publishing" in i.note for i in in_recovery)
    assert v.generation is not None and v.generation >= len({f.step for f in sc.schedule.faults})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_respawn_of_a_rank_that_took_a_second_spare(tmp_path_factory: pytest.TempPathFactory) -> None:
    """1 node x 2 workers + a spare node with 3 spares (standby ranks 0, 1, 0). Kill rank 1 (spare1 takes
    it), rank 1 again (spare0 re-execs as rank 1), rank 0 (spare2 takes it: none left), rank 0 again: a
    respawn on the spare node, which must land in spare2's slot, not in slot 0 (alive, rank 1)."""
    root = tmp_path_factory.mktemp("slot")
    kill = FaultKind.KILL_WORKER
    faults = (Fault(5, kill, (1,)), Fault(10, kill, (1,)), Fault(15, kill, (0,)), Fault(20, kill, (0,)))
    spec = ClusterSpec(nodes=1, nproc_per_node=2, spare_nodes=1, spares_per_spare_node=3, steps=30)
    sc = Scenario("respawn-slot", "kill ranks 1, 1, 0, 0", "bitwise equal", spec,
                  Schedule(0, ScheduleConfig(steps=30, world_size=2, nproc_per_node=2), faults), run_timeout_s=120.0)
    v = run_scenario(sc, root, BaselineCache(root), log=lambda _line: None)
    assert v.passed, render_table([v])
