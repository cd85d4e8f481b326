"""torch's NCCL settings (ckptless/worker/nccl_env.py): what a worker gets, what is refused, what warns.

The behaviours behind them were measured on real NCCL (docs/gpu-runs/2026-11-28-h200/nccl_facts.json): with
torch's defaults a process whose first NCCL group formed after a failure elsewhere was ended 14 s later (the
heartbeat timeout there being 8 s); with monitoring or dumping off it lived. The stand-in that models them on
CPU: tests/harness/nccl_like.py; the end-to-end check: tests/e2e/test_nccl_machinery_e2e.py.
"""

from __future__ import annotations

import pytest

from ckptless import environment
from ckptless.errors import ConfigError
from ckptless.worker import nccl_env


def test_a_worker_gets_every_setting_unless_the_user_set_it() -> None:
    got = nccl_env.for_workers({})
    assert got == {s.name: s.value for s in nccl_env.SETTINGS}
    assert got["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and got["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    mine = nccl_env.for_workers({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "90", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert mine["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "90" and mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


@pytest.mark.parametrize("env, field", [
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "yes"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    # the combination that ends each later replacement: monitor on, dumping on
    ({"TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}, "TORCH_NCCL_DUMP_ON_TIMEOUT"),
    # monitor on with a heartbeat timeout under the watchdog's post-error sleep: a normal error looks like a hang
    ({"TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "20",
      "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000"}, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"),
    ({"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "soon"}, "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"),
])
def test_a_setting_that_lets_torch_end_a_recovery_is_refused_naming_it(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        nccl_env.check(env)
    assert err.value.field == field and str(err.value.value) == env.get(field, err.value.value)


def test_settings_that_only_cost_time_warn() -> None:
    assert nccl_env.check({}) == []
    warned = nccl_env.check({"TORCH_NCCL_ENABLE_MONITORING": "1"})  # dumping stays off: only a stuck watchdog kills
    assert len(warned) == 1 and "monitor" in warned[0]
    slow = nccl_env.check({"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "60000"})
    assert len(slow) == 1 and "waits 4x" in slow[0]


def test_init_applies_them_to_its_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for s in nccl_env.SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "120")
    environment.reload()
    try:
        nccl_env.apply(90)
        seen = environment.environ()
        assert seen["TORCH_NCCL_ENABLE_MONITORING"] == "0" and seen["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "120"
        assert seen["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "90"
    finally:
        for s in nccl_env.SETTINGS:
            monkeypatch.delenv(s.name, raising=False)
        monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
        environment.reload()
