"""The backend with NCCL's failure semantics itself (tests/harness/nccl_like.py), on CPU.

What NCCL does when a peer dies, and Gloo does not: the survivors' collective
never raises by itself; it blocks until its communicator is aborted from
another thread, and torch's watchdog tears the process down at the timeout
(torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING=1). This checks that the emulation
does exactly that. The recovery tests that run on it (the survivors leave the
hung step soon after the incident, are never killed, end bitwise):
tests/e2e/test_recovery_e2e.py (a kill at the step's start, in the optimizer
step, inside the capture, a second failure during the recovery) and
tests/e2e/test_ddp_fsdp_e2e.py (DDP and FSDP2, a kill in backward). The same
assertions for real NCCL need two or more GPUs on one machine: they are
written in tests/gpu/test_multi_gpu.py and have not run (docs/architecture.md,
"GPU path").
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path


def test_the_backend_hangs_until_aborted_and_its_watchdog_tears_down(tmp_path: Path) -> None:
    """The emulation itself: a collective whose peer died neither completes nor raises until abort()
    (then raises); in torchrun's mode (1) its watchdog ends the process at the timeout (2 s here)."""
    script = tmp_path / "hang.py"
    script.write_text(r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from tests.harness.nccl_like import NcclLikeGroup
rank, port, mode = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = mode
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=20))
g = NcclLikeGroup(store, rank, 2, datetime.timedelta(seconds=2), "t")
g.allreduce([torch.ones(4)]).wait()  # both alive: completes
if rank == 1:
    os._exit(0)  # the peer dies
t0 = time.monotonic()
w = g.allreduce([torch.ones(4)])
time.sleep(0.5)
print("completed early" if w.is_completed() else "still held", flush=True)
if mode == "0":
    g.abort()
    try:
        w.wait()
        print("no error", flush=True)
    except RuntimeError as e:
        print("raised after abort", round(time.monotonic() - t0, 1), flush=True)
else:
    w.wait()
    print("not torn down", flush=True)
""")
    for mode, expect in (("0", "raised after abort"), ("1", None)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, str(script), str(Path(__file__).resolve().parents[2]), str(r),
                                   str(port), mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in (0, 1)]
        out0, _ = procs[0].communicate(timeout=60)
        procs[1].communicate(timeout=60)
        assert "still held" in out0, out0
        if expect is not None:
            assert expect in out0, out0
        else:
            assert "tearing the process down" in out0 and procs[0].returncode == -signal.SIGABRT, out0
