"""A GPU-class exit from end to end, each part alone: the worker's classification (worker/faults.py), its
machine and exit (worker/machine.py, worker/driver.py), the exit record (recovery/view.py), the facts
and the planner's R2 (recovery/gather.py, recovery/plan.py). No process, no etcd, no GPU: torch's
``AcceleratorError`` is built here as torch builds it (message, then ``error_code`` = the cudaError_t)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ckptless.errors import CollectiveError, ConfigError
from ckptless.recovery import DiskFallback, RecoveryPlan, WaitForReplacement, Worker, plan_recovery
from ckptless.recovery.gather import plan_from_view
from ckptless.recovery.view import ErrorSummary, ExitRecord
from ckptless.worker import exit_file, exit_guard, faults
from ckptless.worker.driver import WorkerDriver
from ckptless.worker.machine import (
    Awaiting,
    DeviceFailed,
    Exit,
    Failed,
    Finishing,
    Forming,
    Joining,
    Leaving,
    Reporting,
    Restoring,
    State,
    Training,
    WorkerConfig,
    step,
)

from ..harness.leader_sim import World as SimWorld
from ..harness.plan_worlds import example_facts

NON_TERMINAL: list[State] = [
    Joining(100.0), Forming(1, 50.0, True), Restoring(1), Training(1, 5, True), Training(1, 5), Finishing(1),
    Leaving(1, "x"), Reporting(1, "x"), Awaiting(1, 70.0),
]


def cuda_error(code: int, message: str = "CUDA error: uncorrectable ECC error encountered") -> BaseException:
    exc = torch.AcceleratorError(message)
    exc.error_code = code  # type: ignore[attr-defined]  # what torch's C++ sets
    return exc


# --- the worker: which CUDA errors mean the GPU failed ----------------------------------------------------
@pytest.mark.parametrize("code", sorted(faults.DEVICE_ERROR_CODES))
def test_a_failed_gpu_is_named_by_its_cuda_error_code(code: int) -> None:
    failed = faults.device_failure(cuda_error(code))
    assert isinstance(failed, DeviceFailed)
    assert failed.error.type == "AcceleratorError"
    assert f"({faults.DEVICE_ERROR_CODES[code]}, {code})" in failed.error.message
    assert "uncorrectable ECC" in failed.error.one_line()


@pytest.mark.parametrize("code", [700, 710, 716, 717, 718, 719, 702, 101, 2, 999])
def test_errors_that_are_usually_the_programs_own_stay_the_users(code: int) -> None:
    """Illegal address, device-side assert, launch failure, out of memory ...: not the GPU's fault."""
    assert faults.device_failure(cuda_error(code, "CUDA error: an illegal memory access")) is None


def test_only_a_coded_accelerator_error_counts_never_the_message() -> None:
    assert faults.device_failure(RuntimeError("CUDA error: uncorrectable ECC error encountered")) is None
    assert faults.device_failure(torch.AcceleratorError("CUDA error: uncorrectable ECC error")) is None  # no code


def test_a_collective_that_broke_because_this_gpu_died_is_this_gpus_failure() -> None:
    try:
        try:
            raise cuda_error(214)
        except torch.AcceleratorError as inner:
            raise CollectiveError("all_reduce failed") from inner
    except CollectiveError as outer:
        failed = faults.device_failure(outer)
    assert failed is not None and "214" in failed.error.message


# --- the machine and the exit ---------------------------------------------------------------------------
@pytest.mark.parametrize("state", NON_TERMINAL, ids=lambda s: type(s).__name__)
def test_a_failed_gpu_ends_the_worker_from_any_state(state: object) -> None:
    error = ErrorSummary("AcceleratorError", "CUDA error: x (cudaErrorECCUncorrectable, 214)", "tb")
    s, acts = step(state, DeviceFailed(error), WorkerConfig())  # type: ignore[arg-type]
    assert isinstance(s, Failed) and s.kind == "device" and s.error == error
    assert acts == (Exit("device", s.message),) and "the GPU failed" in s.message


def test_a_rank_leaving_for_corrupt_replicated_state_does_not_say_its_gpu_failed() -> None:
    """Issue 35, finding 9: the replica check's replacement leaves as a device (its agent marks its GPU
    bad where it has one), but on a CPU job there is no GPU, and what failed is its state."""
    error = ErrorSummary("SilentDataCorruption", "silent data corruption at step 5: rank 2 (on b) is the odd one")
    s, _ = step(Training(0, 5), DeviceFailed(error), WorkerConfig())
    assert isinstance(s, Failed) and s.kind == "device"
    assert "GPU" not in s.message and s.message.startswith("its replicated state is corrupt"), s.message


def test_the_worker_records_device_and_leaves_without_touching_cuda_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "exit.json"
    monkeypatch.setattr(exit_file.environment, "current", lambda: SimpleNamespace(exit_file=str(path)))
    codes: list[int] = []

    def leave_now(code: int) -> None:
        codes.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(exit_guard, "leave_now", leave_now)
    failed = faults.device_failure(cuda_error(214))
    assert failed is not None
    s, _ = step(NON_TERMINAL[4], failed, WorkerConfig())
    assert isinstance(s, Failed)
    with pytest.raises(SystemExit):
        WorkerDriver._raise_failure(SimpleNamespace(rt=SimpleNamespace(rank=3)), s)  # type: ignore[arg-type]
    assert codes == [1]
    kind, error = exit_file.read(str(path))
    assert kind == "device" and error is not None and "cudaErrorECCUncorrectable" in error.message
    assert "rank 3: the GPU failed" in capsys.readouterr().err


# --- the exit record ----------------------------------------------------------------------------------------
def test_exit_record_round_trips_respawnable_and_older_or_malformed_records_still_parse() -> None:
    rec = ExitRecord(1, "a/w1", "a", 42, 1, None, 1.5, kind="device",
                     error=ErrorSummary("AcceleratorError", "ECC"), respawnable=False)
    back = ExitRecord.from_json(rec.to_json())
    assert back == rec and back.outcome == "fault"
    doc = json.loads(rec.to_json())
    del doc["respawnable"]  # an older agent's record
    assert ExitRecord.from_json(json.dumps(doc).encode()).respawnable
    for bad in ("no", 0, None, [False]):
        doc["respawnable"] = bad  # malformed: ignored (the default), the exit itself still counts
        assert ExitRecord.from_json(json.dumps(doc).encode()) == replace(rec, respawnable=True)
    never = ExitRecord(1, "a/respawn-g2-r1", "a", -1, None, None, 2.0, kind="device",
                       error=ErrorSummary("NoFreeGPU", "no free good GPU"), respawnable=False)
    assert never.outcome == "fault" and "was not started: NoFreeGPU" in never.describe()


# --- the planner: never a respawn onto a node whose GPU for the rank failed ---------------------------------
def test_r2_a_rank_whose_node_cannot_restart_it_takes_a_spare_or_waits() -> None:
    f = replace(example_facts(spares=(Worker("c/spare", "c"),), prefer="respawn"), no_respawn=frozenset({1}))
    d = plan_recovery(f)
    assert isinstance(d, RecoveryPlan) and d.assignments[1].source == "spare"  # even where respawn is preferred
    w = plan_recovery(replace(f, spares=()))
    assert isinstance(w, WaitForReplacement) and w.unassigned_ranks == (1,) and w.generation == f.generation
    assert "GPU failed" in w.reason
    with pytest.raises(ConfigError, match="no_respawn"):
        replace(f, no_respawn=frozenset({0}))  # rank 0 is alive


def test_r2_the_last_spare_goes_to_the_rank_that_cannot_respawn() -> None:
    f = replace(example_facts(spares=(Worker("c/spare", "c"),)), no_respawn=frozenset({1}))
    members = tuple(replace(s, alive=s.rank not in (0, 1)) for s in f.members)
    f = replace(f, members=members, reports=f.reports[1:])
    d = plan_recovery(f)  # rank 0 comes first by number, but rank 1 has no other way
    assert isinstance(d, (RecoveryPlan, DiskFallback))
    assert d.assignments[1].source == "spare" and d.assignments[0].source == "respawn"


def test_the_leader_reads_it_from_the_current_workers_exit_record() -> None:
    w = SimWorld()
    w.kill(1)
    w.exits[1] = replace(w.exits[1], signal=None, exitcode=1, kind="device", respawnable=False)
    w.report(0), w.report(2), w.report(3)
    d, _ = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None)
    assert isinstance(d, WaitForReplacement) and d.unassigned_ranks == (1,)
    w.spares.append(Worker("n2/spare0", "n2"))
    w.nodes.add("n2")
    d, _ = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None)
    assert isinstance(d, RecoveryPlan) and d.rank_to_worker[1] == "n2/spare0"
    # a GPU left on the node (respawnable), or an older incarnation's record: a respawn as ever
    w.spares.clear()
    for rec in (replace(w.exits[1], respawnable=True), replace(w.exits[1], worker_id="n0/older")):
        w.exits[1] = rec
        d, _ = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None)
        assert isinstance(d, RecoveryPlan) and d.assignments[1].source == "respawn"
