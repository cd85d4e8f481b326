"""A replacement's setup builds what the original's built (issue 17: it could train silently on other data).

* An unseeded script that draws from the global torch RNG during its setup: a
  respawned replacement re-runs the setup; ``ckptless.init()`` seeded it the same
  way, so it draws the same numbers.
* A script whose setup reads its rank (``os.environ["RANK"]``) and keeps
  rank-specific, unprotected state: a pre-built spare built as another rank
  (``--spare-any-rank``) must not take the lost rank with its objects as built.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd

from .recovery_harness import Cluster, assert_bitwise_equal, run_fault_free
from .waiting import wait_until

KNOBS = {"REF_UNSEEDED_DATA": "1", "REF_SETUP_READS_RANK": "1"}


def _cluster(etcd: EmbeddedEtcd, tmp_path: Path, name: str, **env: str) -> Cluster:
    out = tmp_path / name
    out.mkdir()
    return Cluster(etcd.endpoint, out, f"{name}-{uuid.uuid4().hex[:6]}", env={**KNOBS, **env})


@pytest.fixture(scope="module")
def baseline(module_etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, object]]:
    return run_fault_free(_cluster(module_etcd, tmp_path_factory.mktemp("base"), "baseline"))


def test_unseeded_setup_is_redrawn_the_same_by_a_replacement(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                             baseline: dict) -> None:
    c = _cluster(module_etcd, tmp_path, "unseeded", REF_PAUSE_RANK="1", REF_PAUSE_STEP="5")
    try:
        c.start_agent()
        c.start_agent()
        os.kill(c.paused_pid(1), signal.SIGKILL)
        c.wait()
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline)
    assert c.pids(1)[-1]["role"] == "replacement"
    assert "does not seed torch before ckptless.init()" in c.log_text()  # the script is told, once


def test_spare_whose_setup_read_its_rank_restarts_as_the_lost_rank(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                  baseline: dict) -> None:
    c = _cluster(module_etcd, tmp_path, "readsrank", REF_PAUSE_RANK="1", REF_PAUSE_STEP="5")
    try:
        c.start_agent()
        c.start_agent()
        c.start_agent("--spares", "1", "--spare-any-rank", nproc=0)
        pid = c.paused_pid(1)
        wait_until(lambda: any(c.out.glob("standby_*.json")), 120, "the spare built and standing by")
        standby = [json.loads(p.read_text())["rank"] for p in c.out.glob("standby_*.json")]
        assert standby == [0]
        os.kill(pid, signal.SIGKILL)
        c.wait()
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline)
    text = c.log_text()
    assert "its setup read its rank (os.environ['RANK'] at" in text, c.tail()
    assert "train_ref.py" in text.split("its setup read its rank", 1)[1][:300]
