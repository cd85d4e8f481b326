"""Recovery on real NCCL, one GPU per rank: the CPU tests' assertions on several GPUs (never run yet).

Why a file of its own: NCCL refuses two ranks of one communicator on one GPU,
and the only GPU machine lent so far has one GPU, so these have never run.
They are the real-NCCL twins of the CI tests on the backend with NCCL's
failure semantics (tests/e2e/test_recovery_e2e.py): the same reference job
(tests/harness/scripts/train_ref.py, here with ``REF_DEVICE=cuda``) and the
same assertions. The survivors leave the hung all-reduce soon after the
incident, are never killed (neither by ckptless nor by torch's NCCL
watchdog), and the job ends bitwise equal to its fault-free run.

Shape: two agents on this host stand for two nodes, each given its own GPUs
through ``CUDA_VISIBLE_DEVICES``. With 4 or more GPUs it is the CPU tests'
shape (2 agents x 2 ranks); with 2 or 3 it is 2 agents x 1 rank. A spare
needs one GPU more than the world. Skipped with the GPU count named where
there are fewer.

``NCCL_ALGO=Ring``: a sum over 4 ranks is bitwise the same in every run only
if NCCL adds in the same order; a spare on another GPU must not let NCCL
choose another algorithm (NVLS, a tree) for the run it is compared with.

``TEST_MULTI_GPU_ON_CPU=<gpus>`` runs this file on CPU with the
NCCL-semantics backend standing for NCCL, as if the host had that many GPUs
(each agent still gets its ``CUDA_VISIBLE_DEVICES``; the workers stay on the
CPU). That checks this file's own logic where no GPU is at hand; what it
shows about NCCL is what the CI tests show already.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ckptless.coordinator.embedded import EmbeddedEtcd

from ..harness import nccl_like
from ..harness.cluster import (Cluster, FaultFree, assert_bitwise_equal, assert_survivors_kept_pids,
                               independent_pair, left_after_incident, new_cluster, wait_membership,
                               wait_spare_standing_by)
from ..harness.waiting import wait_json

EMULATED = os.environ.get("TEST_MULTI_GPU_ON_CPU")
GPUS = int(EMULATED) if EMULATED else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
PER_AGENT = 2 if GPUS >= 4 else 1
WORLD = 2 * PER_AGENT
LEFT_WITHIN_S = 5.0  # after the incident opened; torch's watchdog, the only other way out, acts at 30 s

pytestmark = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more GPUs on one host (this one has {GPUS}): "
                                "NCCL refuses two ranks of one communicator on one GPU")

# torch's NCCL watchdog: what it prints when it times a collective out or tears the process down.
WATCHDOG_LINES = ("Watchdog caught collective operation timeout", "To avoid data inconsistency, we are taking "
                  "the entire process down", "ProcessGroupNCCL's watchdog got stuck")


def _job_env() -> dict[str, str]:
    if EMULATED:
        return {**nccl_like.job_env(), "CKPTLESS_NODE_GPUS": "0"}
    # CKPTLESS_NODE_GPUS empty: each agent counts its CUDA_VISIBLE_DEVICES (the tests' default is 0).
    return {"REF_DEVICE": "cuda", "CKPTLESS_CUDA_BACKEND": "nccl", "CKPTLESS_NODE_GPUS": "",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}


def _gpus(first: int, n: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(first, first + n))}


@dataclass
class Job:
    cluster: Cluster
    goodput: Path

    def start_members(self) -> None:
        for node in range(2):
            self.cluster.start_agent("--goodput-dir", str(self.goodput), nproc=PER_AGENT,
                                     env=_gpus(node * PER_AGENT, PER_AGENT))

    def start_spare_agent(self) -> None:
        self.cluster.start_agent("--goodput-dir", str(self.goodput), "--spares", "1", nproc=0,
                                 env=_gpus(WORLD, 1))

    def run(self, fault: Callable[[], None], spare: bool = False, timeout: float = 240) -> None:
        """Start the members (and the spare agent), inject ``fault``, wait for every agent's exit 0."""
        try:
            self.start_members()
            if spare:
                self.start_spare_agent()
            fault()
            self.cluster.wait(timeout)
        finally:
            self.cluster.kill_all()

    def assert_no_backstop(self) -> None:
        """Nobody waited for a watchdog, and (on the emulation) no communicator connected late."""
        text = self.cluster.log_text()
        for line in (*WATCHDOG_LINES, "[nccl_like] watchdog", "[nccl_like] connected lazily"):
            assert line not in text, f"{line!r} in the job's logs"


def _job(etcd: EmbeddedEtcd, root: Path, name: str, **env: str) -> Job:
    c = new_cluster(etcd.endpoint, root, name, **_job_env(), **env)
    return Job(c, c.out / "goodput")


@pytest.fixture(scope="module")
def gpu_baseline(module_etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFree]:
    job = _job(module_etcd, tmp_path_factory.mktemp("multi-gpu"), "baseline")
    job.run(lambda: None)
    finals = job.cluster.finals(WORLD)
    assert all(int(f["recoveries"]) == 0 for f in finals.values())  # type: ignore[call-overload]
    if not EMULATED:
        assert "rng_cuda" in finals[0], "the job did not train on the GPU"
    yield FaultFree(job.cluster, finals)


def _assert_recovered(job: Job, want: FaultFree, lost: set[int]) -> None:
    assert_bitwise_equal(job.cluster.finals(WORLD), want.finals)
    assert_survivors_kept_pids(job.cluster, lost, WORLD)
    job.assert_no_backstop()


def test_survivors_leave_a_hung_nccl_allreduce_and_are_never_killed(
        module_etcd: EmbeddedEtcd, tmp_path: Path, gpu_baseline: FaultFree) -> None:
    """The last rank dies at the start of step 5; the survivors block in step 5's all-reduce, whose
    kernel spins on their GPUs, until ckptless aborts the generation's communicators."""
    victim = WORLD - 1
    job = _job(module_etcd, tmp_path, "hung", REF_PAUSE_RANK=str(victim), REF_PAUSE_STEP="5")
    job.run(lambda: os.kill(job.cluster.paused_pid(victim), signal.SIGKILL))
    _assert_recovered(job, gpu_baseline, {victim})
    left = left_after_incident(job.goodput, set(range(WORLD)) - {victim})
    print(f"survivors left the hung step {left} s after the incident")
    assert all(dt < LEFT_WITHIN_S for dt in left.values()), f"survivors left the hung step late: {left}"


def test_killed_in_the_optimizer_step_respawned_on_its_gpu(
        module_etcd: EmbeddedEtcd, tmp_path: Path, gpu_baseline: FaultFree) -> None:
    """Rank 1 dies after its all-reduce and before its optimizer step: its peers finish step 5, capture
    it asynchronously (copies queued behind the step), and hang in step 6's all-reduce."""
    job = _job(module_etcd, tmp_path, "respawn", REF_PAUSE_RANK="1", REF_PAUSE_STEP="5", REF_PAUSE_WHERE="optimizer")
    job.run(lambda: os.kill(job.cluster.paused_pid(1), signal.SIGKILL))
    _assert_recovered(job, gpu_baseline, {1})
    assert job.cluster.pids(1)[-1]["role"] == "replacement"


@pytest.mark.skipif(GPUS < WORLD + 1, reason=f"a spare needs a GPU of its own: {WORLD + 1} GPUs, this host has {GPUS}")
def test_killed_inside_the_capture_a_spare_on_its_own_gpu_takes_the_rank(
        module_etcd: EmbeddedEtcd, tmp_path: Path, gpu_baseline: FaultFree) -> None:
    """Rank 0 dies inside the capture of version 5 (its device-to-host copies queued, not yet handed to
    its mirror engine); a pre-built spare on the spare agent's GPU takes rank 0 and restores its
    state onto its own device (images name the device type, not the index)."""
    chaos = tmp_path / "chaos"
    job = _job(module_etcd, tmp_path, "spare", CKPTLESS_CHAOS_DIR=str(chaos), CKPTLESS_CHAOS_POINTS="cap=capture:r0:5")

    def kill_once_the_spare_stands_by() -> None:
        paused = wait_json(chaos / "paused_cap.json", 120)
        assert paused["point"] == "capture:r0:5"
        wait_spare_standing_by(job.cluster, 0)
        os.kill(int(paused["pid"]), signal.SIGKILL)

    job.run(kill_once_the_spare_stands_by, spare=True)
    _assert_recovered(job, gpu_baseline, {0})
    assert job.cluster.pids(0)[-1]["role"] == "spare"


@pytest.mark.skipif(WORLD < 4, reason=f"two independent failures need 4 ranks, one GPU each (this host has {GPUS})")
def test_second_failure_while_recovering_aborts_the_formation_too(
        module_etcd: EmbeddedEtcd, tmp_path: Path, gpu_baseline: FaultFree) -> None:
    """A second rank dies while the first failure's recovery forms the next generation: the forming
    communicators (non-blocking init) are aborted as well as the broken generation's."""
    a, b = independent_pair()
    job = _job(module_etcd, tmp_path, "during", REF_PAUSE_RANK=str(a), REF_PAUSE_STEP="5")

    def kill_twice() -> None:
        os.kill(job.cluster.paused_pid(a), signal.SIGKILL)
        wait_membership(job.cluster, 1)  # the recovery of the first failure is under way ...
        os.kill(int(job.cluster.pids(b)[0]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]  # ... a second dies

    job.run(kill_twice)
    assert_bitwise_equal(job.cluster.finals(WORLD), gpu_baseline.finals)
    m = job.cluster.membership()
    assert m is not None and m.generation >= 2
    assert_survivors_kept_pids(job.cluster, {a, b}, WORLD)
    job.assert_no_backstop()
