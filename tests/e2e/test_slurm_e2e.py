"""deploy/slurm/ckptless.sbatch on a real (local) Slurm, a worker killed: bitwise equal to the fault-free run.

A one-node Slurm (munged, slurmctld, slurmd from Debian's slurm-wlm, started by the
test in a temporary directory: tests/harness/slurm.py) runs the recipe as a user
would: ``sbatch ckptless.sbatch examples/ddp_train.py ...`` with the etcd endpoint
in the environment; the batch script ``srun``s one ckptless-run agent per node.
Rank 1 pauses at the start of step 5 (the example's EXAMPLE_PAUSE) and is
SIGKILLed; the job ends (``sbatch --wait`` exits 0) with every rank's
parameters, optimizer state, LR, RNG draws and data position ``torch.equal`` to
a fault-free run of the same script under ``ckptless-run --standalone``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd

from ..harness import slurm
from ..harness.cluster import assert_bitwise_equal, wait_exit
from ..harness.repo import PYTHON, REPO, child_env
from ..harness.waiting import wait_until

SCRIPT = str(REPO / "examples" / "ddp_train.py")
STEPS = 12
WORLD = 2


def _finals(out: Path) -> dict[int, dict[str, object]]:
    import torch

    finals = {r: torch.load(out / f"final_rank{r}.pt", weights_only=True) for r in range(WORLD)}
    for f in finals.values():
        f.pop("pid")
    return finals


@pytest.mark.rotating(3)  # CI budget: tests/harness/rotation.py (the kill and recovery are the launcher's, tested daily)
@pytest.mark.timeout(300)
def test_sbatch_recipe_on_local_slurm_survives_a_kill_bitwise(module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    why = slurm.missing()
    if why is not None:
        pytest.skip(why)
    env = child_env()
    env["PATH"] = str(Path(PYTHON).parent) + os.pathsep + env.get("PATH", "")
    base = tmp_path / "base"
    base.mkdir()
    proc = subprocess.Popen([PYTHON, "-m", "ckptless.launcher.main", "--standalone", "--nproc-per-node", str(WORLD),
                             SCRIPT, "--steps", str(STEPS), "--out", str(base)], env=env, cwd=tmp_path,
                            stdout=open(tmp_path / "base.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    assert wait_exit(proc, 240, "the fault-free run") == 0, (tmp_path / "base.log").read_text()[-3000:]
    baseline = _finals(base)

    out = tmp_path / "slurm"
    out.mkdir()
    job_env = {**env, "CKPTLESS_ETCD_ENDPOINT": module_etcd.endpoint, "NPROC_PER_NODE": str(WORLD),
               "EXAMPLE_PAUSE": "1:5:start"}
    with slurm.LocalSlurm(tmp_path / "cluster") as cluster:
        job = cluster.sbatch(["--nodes=1", f"--output={out / 'job.out'}", str(REPO / "deploy" / "slurm" / "ckptless.sbatch"),
                              SCRIPT, "--steps", str(STEPS), "--out", str(out)], job_env, cwd=tmp_path)
        paused = out / "paused_rank1.json"
        try:
            wait_until(paused.exists, 240, "rank 1 paused at step 5 under Slurm", interval_s=0.05)
            doomed = json.loads(paused.read_text())["pid"]
            os.kill(doomed, signal.SIGKILL)
            code = wait_exit(job, 240, "sbatch --wait")  # type: ignore[arg-type]
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
        text = (out / "job.out").read_text(errors="replace") if (out / "job.out").exists() else ""
        assert code == 0, f"{job.stdout.read() if job.stdout else ''}\n{text[-4000:]}\n{cluster.logs()}"
    finals = _finals(out)
    assert_bitwise_equal(finals, baseline)
    assert all(int(f["recoveries"]) == 1 for f in finals.values())  # type: ignore[call-overload]
