"""What only a GPU can show (``make test-gpu``; skipped without CUDA).

One GPU is what this workplace lends, and NCCL refuses two ranks of one
communicator on one GPU, so the multi-rank NCCL failure runs in CI on CPU
(tests/e2e/test_nccl_semantics_e2e.py, the backend with NCCL's failure
semantics) and, on a host with several GPUs, in tests/gpu/test_multi_gpu.py
(never run yet). Here, on the real device: ckptless's NCCL communicators made and
aborted many times without leaks, a connect and a spinning kernel released by
the abort path, the asynchronous capture and the restore bitwise (a plain
model, DDP, FSDP2), a torn capture detected, the CUDA generator exact in a new
process, page-locked pool buffers, and a multi-process job sharing the GPU
killed and recovered bitwise (its collectives on Gloo: ``CKPTLESS_CUDA_BACKEND=gloo``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from ckptless.coordinator.embedded import EmbeddedEtcd

from ..harness.cluster import assert_recovered, fault_free, new_cluster
from .conftest import run_script

GPU_JOB = {"REF_DEVICE": "cuda", "CKPTLESS_CUDA_BACKEND": "gloo", "CKPTLESS_NODE_GPUS": "0",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_nccl_create_use_abort_50_times_leaks_nothing(gpu_out: Path) -> None:
    r = run_script(gpu_out, "nccl_paths", "cycle")
    a, b = r["after_5"], r["after_50"]
    assert b["threads"] <= a["threads"] + 2, r
    assert b["fds"] <= a["fds"] + 4, r
    assert b["torch_allocated"] <= a["torch_allocated"], r
    assert a["gpu_free"] - b["gpu_free"] < 64 << 20, r  # NCCL's own buffers come back too


def test_an_abandoned_formation_is_released_by_the_abort(gpu_out: Path) -> None:
    # torch's abort of a communicator still in its non-blocking init waits for that init, up to
    # TORCH_NCCL_NONBLOCKING_TIMEOUT (ckptless.init() sets it to the formation timeout): the abandoned
    # helper thread is out by then, never after the collective timeout (60 s) or torch's default (30 min).
    # The first GPU run measured 18.0 s with it at 20 s, the abort 3 s into the connect.
    r = run_script(gpu_out, "nccl_paths", "forming", env={"TORCH_NCCL_NONBLOCKING_TIMEOUT": "8"})
    assert r["stuck_before_abort"] and r["aborted"] >= 1, r
    assert r["released"] and r["released_after_s"] < 8 + 4, r


def test_a_thread_in_a_cuda_sync_behind_a_spinning_kernel_is_released(gpu_out: Path) -> None:
    # Two GPUs: a world-2 all-reduce whose peer was SIGKILLed. One GPU: NCCL refuses the self-receive
    # that would spin, so the case is skipped (the CPU backend with NCCL's semantics shows it in CI).
    r = run_script(gpu_out, "nccl_paths", "hung")
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert "failed" not in r, r
    assert r["released"] and r["released_after_s"] < 10, r


@pytest.mark.parametrize("kind", ["plain", "ddp", "fsdp2"])
def test_async_capture_is_exact_and_restore_retraces_bitwise(gpu_out: Path, kind: str) -> None:
    r = run_script(gpu_out, "capture_restore", kind)
    assert r["torn"] == 0 and r["clean"] == 10, r
    assert r["retrace_bitwise"], r


def test_a_script_that_writes_outside_its_optimizer_step_is_found_by_the_probe(gpu_out: Path) -> None:
    r = run_script(gpu_out, "capture_restore", "writer")
    assert r["torn"] == 0 and r["clean"] == 10, r  # the probe ordered its first captures: nothing could race
    assert r["conservative"], r


def test_a_write_after_the_probe_tears_the_image_and_is_never_silent(gpu_out: Path) -> None:
    r = run_script(gpu_out, "capture_restore", "late-writer")
    assert r["torn"] >= 1 and r["torn"] + r["clean"] == 10, r  # every clean image equalled its reference
    assert r["conservative"], r


def test_cuda_rng_is_exact_in_a_new_process(gpu_out: Path, tmp_path: Path) -> None:
    run_script(gpu_out, "rng_device", "save", str(tmp_path / "rng.pt"))
    run_script(gpu_out, "rng_device", "load", str(tmp_path / "rng.pt"))


def test_pool_buffers_are_page_locked_and_unregistered_when_dropped() -> None:
    import shutil
    import tempfile

    from ckptless.mirror import buffers
    from ckptless.mirror.ownimage import OwnImageFiles
    from ckptless.state import host_memory

    torch.cuda.init()
    before = host_memory.registered_bytes()
    anon, path = buffers.allocate(None, 1 << 20)
    assert path is None and host_memory.pinned(anon)
    shm = tempfile.mkdtemp(prefix="ckptless-gpu-", dir="/dev/shm")  # the tier's real place: tmpfs
    files = OwnImageFiles(shm, "job", "node", 0)
    mapped, path = buffers.allocate(files, 1 << 20)
    assert path is not None and host_memory.pinned(mapped)
    assert host_memory.registered_bytes() == before + (1 << 20)
    mapped.copy_(torch.arange(1 << 20, device="cuda").to(torch.uint8), non_blocking=True)
    torch.cuda.synchronize()
    buffers.drop(mapped, path, None, 10)
    assert host_memory.registered_bytes() == before
    shutil.rmtree(files.shm_dir, ignore_errors=True)


def test_a_job_sharing_the_gpu_is_killed_and_recovered_bitwise(tmp_path: Path) -> None:
    d = tmp_path / "etcd"
    with EmbeddedEtcd(data_dir=d / "data", log_path=d / "etcd.log") as etcd:
        want = fault_free(etcd.endpoint, tmp_path, **GPU_JOB)
        c = new_cluster(etcd.endpoint, tmp_path, "gpu-kill", REF_PAUSE_RANK="1", REF_PAUSE_STEP="5", **GPU_JOB)
        try:
            c.start_agent()
            c.start_agent()
            os.kill(c.paused_pid(1), signal.SIGKILL)
            c.wait(240)
        finally:
            c.kill_all()
        assert "rng_cuda" in want.finals[0], "the GPU job did not train on the GPU"
        assert_recovered(c, want, lost={1})


def test_a_spare_without_a_free_gpu_is_refused_naming_the_gpus(tmp_path: Path) -> None:
    n = torch.cuda.device_count()
    d = tmp_path / "etcd"
    with EmbeddedEtcd(data_dir=d / "data", log_path=d / "etcd.log") as etcd:
        # The node's real GPU count (the tests' default says 0: a CPU job on a GPU host).
        c = new_cluster(etcd.endpoint, tmp_path, "gpu-spare", REF_DEVICE="cuda", CKPTLESS_NODE_GPUS="")
        try:
            agent = c.start_agent("--spares", "1", nproc=n, nnodes="1")
            code = agent.wait(120)
        finally:
            c.kill_all()
        assert code == 2, c.log_text()[-3000:]
        assert f"which has {n} (" in c.log_text(), c.log_text()[-3000:]
