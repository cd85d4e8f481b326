"""A whole job killed (every process at once) and started again with the same command resumes from its
newest verified disk snapshot, and ends bitwise equal to the run that was never killed.

Real processes: `ckptless-run --standalone` with its embedded etcd, SIGKILLed as a process group
(agent, workers, fork server, etcd), then the same command again.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from .conftest import PYTHON, REPO, child_env
from .recovery_harness import assert_bitwise_equal
from .waiting import wait_json, wait_until

TRAIN = str(REPO / "tests" / "scripts" / "train_ref.py")


def _run(out: Path, snaps: Path, name: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = child_env()
    env.update({"REF_STEPS": "10", "CKPTLESS_LOG_LEVEL": "INFO", **(extra_env or {})})
    with open(out / f"{name}.log", "w") as log:  # a file, not a pipe nobody reads (it would fill and block)
        return subprocess.Popen(
            [PYTHON, "-m", "ckptless.launcher.main", "--standalone", "--nproc-per-node", "2", "--snapshot-every",
             "2", "--snapshot-dir", str(snaps), "--goodput-dir", str(out / "goodput"), TRAIN, str(out)],
            env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finals(out: Path) -> dict[int, dict[str, object]]:
    import torch

    return {r: torch.load(out / f"final_rank{r}.pt", weights_only=True) for r in range(2)}


@pytest.mark.timeout(420)
def test_whole_job_restart_resumes_from_the_newest_snapshot(tmp_path: Path) -> None:
    base_out, out = tmp_path / "base", tmp_path / "run"
    base_out.mkdir()
    out.mkdir()
    base = _run(base_out, tmp_path / "base-snaps", "base")
    assert base.wait(timeout=300) == 0, (base_out / "base.log").read_text()

    snaps = tmp_path / "snaps"
    first = _run(out, snaps, "first", {"REF_PAUSE_RANK": "0", "REF_PAUSE_STEP": "7"})
    try:
        wait_json(out / "paused_rank0.json", 240)
        wait_until(lambda: any(snaps.rglob("COMPLETE.json")), 120, "a complete snapshot")
        os.killpg(first.pid, signal.SIGKILL)  # the whole job: agent, workers, etcd
        first.wait(30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert not (out / "final_rank0.pt").exists()
    newest = max(int(p.parent.name.split("_")[1]) for p in snaps.rglob("COMPLETE.json"))

    again = _run(out, snaps, "again")
    code = again.wait(timeout=300)
    log = (out / "again.log").read_text()
    assert code == 0, log
    assert f"resumes from its disk snapshot of step {newest}" in log, log
    assert_bitwise_equal(_finals(out), _finals(base_out))
    ledger = (out / "goodput" / "rank0.jsonl").read_text()
    assert '"disk_restore"' in ledger and '"steps_lost"' in ledger
