"""Recovery on a backend with NCCL's failure semantics (tests/harness/nccl_like.py), on CPU.

What NCCL does when a peer dies, and Gloo does not: the survivors' collective
never raises by itself; it blocks until its communicator is aborted from
another thread, and torch's watchdog tears the process down at the timeout
(torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING=1). The job's groups run on that
backend here (CKPTLESS_CPU_BACKEND=nccl_like). ckptless must abort the broken
generation itself (ckptless/worker/abort.py): the survivors leave the hung
step soon after the coordinator's detection, are never killed, re-form, and
end bitwise equal to the fault-free run. Without the abort, they hang until
the watchdog ends them (30 s here), with the replicas they hold.

The same assertions for real NCCL need two or more GPUs on one machine; they
have not run (docs/architecture.md, "GPU path").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


from ckptless.coordinator.embedded import EmbeddedEtcd

from ..harness import nccl_like
from ..harness.cluster import FaultFree, assert_recovered, new_cluster

NCCL_LIKE = nccl_like.job_env()
LEFT_WITHIN_S = 10.0  # after the incident opened; the watchdog (the only other way out) acts at 30 s


def _events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _left_after_incident(goodput: Path, survivors: set[int]) -> dict[int, float]:
    """Seconds from the leader's incident to each survivor leaving generation 0 (wall clocks, one host)."""
    opened = [e for e in _events(goodput / "leader.jsonl") if e["kind"] == "incident_opened"]
    assert opened, "the leader opened no incident"
    t0 = float(opened[0]["t_wall"])  # type: ignore[arg-type]
    out = {}
    for r in survivors:
        left = [e for e in _events(goodput / f"rank{r}.jsonl")
                if e["kind"] == "failure_detected" and e["generation"] == 0]
        assert left, f"survivor rank {r} never left generation 0"
        out[r] = float(left[0]["t_wall"]) - t0  # type: ignore[arg-type]
    return out


def test_survivors_leave_a_hung_collective_and_are_never_killed(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                baseline: FaultFree) -> None:
    c = new_cluster(module_etcd.endpoint, tmp_path, "nccl-like", REF_PAUSE_RANK="1", REF_PAUSE_STEP="5",
                    **NCCL_LIKE)
    goodput = c.out / "goodput"
    try:
        c.start_agent("--goodput-dir", str(goodput))
        c.start_agent("--goodput-dir", str(goodput))
        os.kill(c.paused_pid(1), signal.SIGKILL)
        c.wait(180)
    finally:
        c.kill_all()
    assert "[nccl_like] watchdog" not in c.log_text()  # nobody waited for the backstop
    assert "[nccl_like] connected lazily" not in c.log_text()  # every communicator formed in its formation
    assert_recovered(c, baseline, lost={1})
    left = _left_after_incident(goodput, {0, 2, 3})
    assert all(dt < LEFT_WITHIN_S for dt in left.values()), f"survivors left the hung step late: {left}"


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
