"""The chaos matrix: real agents, real workers, real signals, each run against its fault-free twin.

CI runs one bounded, seeded scenario (not marked slow): a hang and a kill of
different ranks at fixed steps on 2 nodes x 2 workers, plus its baseline --
two job runs, about 60-80 s on 2 cores. The full matrix (every scenario of
``ckptless-chaos list`` and more seeds) is ``@pytest.mark.slow``.
"""

from __future__ import annotations


import pytest

from ckptless.chaos.main import catalogue, random_scenario
from ckptless.chaos.scenario import BaselineCache, Scenario, render_table, run_scenario
from ckptless.chaos.schedule import FaultKind

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
@pytest.mark.parametrize("name", sorted(catalogue()))
def test_matrix_scenario(name: str, baselines: BaselineCache) -> None:
    _check(catalogue()[name], baselines)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("seed", [1, 7, 8])
def test_matrix_seeded(seed: int, baselines: BaselineCache) -> None:
    _check(random_scenario(seed), baselines)


def test_catalogue_is_valid_and_named_uniquely() -> None:
    cat = catalogue()
    assert {"kill-worker", "hang-worker", "node-loss", "leader-loss", "etcd-restart", "two-groups",
            "beyond-k-disk"} <= set(cat)
    for sc in cat.values():
        assert sc.schedule.faults and sc.fault and sc.expected
        if any(f.kind is FaultKind.HANG_WORKER for f in sc.schedule.faults):
            assert sc.spec.hang_timeout, sc.name
        if any(f.kind.loses_node for f in sc.schedule.faults):
            assert sc.spec.spare_nodes * sc.spec.spares_per_spare_node >= sc.spec.nproc_per_node, sc.name
    assert cat["beyond-k-disk"].expect_disk and cat["beyond-k-disk"].spec.snapshot_every
