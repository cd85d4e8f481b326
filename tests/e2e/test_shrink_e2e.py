"""Going on with fewer ranks (issue 22, ``--lost-node shrink``): a node lost with no spare, real processes.

Real etcd, two agents x two workers of examples/ddp_train.py (DDP, a DistributedSampler behind a
stock DataLoader, dropout, gradient clipping, AdamW, OneCycle), ``--nnodes 1:2``. Rank 2 holds at
the start of step 8; the test SIGKILLs its whole node (the agent; its workers die with it). With
no spare and no node to respawn on, the leader hosts ranks 2 and 3 on the survivors holding their
images: the job goes on with two processes for four ranks, each also running a lost rank's
micro-batch of every step, and finishes. What must hold:

* the survivors finish in their first processes, with one recovery;
* every survivor's RNG streams and data position end bitwise equal to the fault-free run's (the
  hosted micro-batches drew from the lost ranks' streams, not the hosts');
* parameters and optimizer state end within floating-point reduction order of the fault-free
  run: the difference is printed (and recorded in docs/failure-model.md, "Fewer ranks").
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from ckptless.coordinator.embedded import EmbeddedEtcd

from ..harness.cluster import descendants
from ..harness.waiting import wait_json
from .test_ddp_fsdp_e2e import DDP_SCRIPT, _baseline, _run

SHRINK = ("--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=300", "--lost-node", "shrink")


def _max_diff(a: object, b: object) -> float:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys()
        return max((_max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return max((_max_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    assert a == b, (a, b)
    return 0.0


def test_node_lost_without_spares_the_survivors_go_on_with_fewer_ranks(module_etcd: EmbeddedEtcd,
                                                                       tmp_path: Path) -> None:
    want = _baseline(module_etcd, tmp_path, DDP_SCRIPT)
    c = _run(module_etcd, tmp_path / "shrink", DDP_SCRIPT, EXAMPLE_PAUSE="2:8")
    try:
        c.start_agent(*SHRINK)
        c.start_agent(*SHRINK)
        paused = wait_json(c.out / "paused_rank2.json", 120)
        first = c.worker_pids()
        victim = next(a for a in c.agents if int(paused["pid"]) in descendants(a.pid))
        survivor = next(a for a in c.agents if a is not victim)
        os.kill(victim.pid, signal.SIGKILL)
        code = survivor.wait(timeout=240)
    finally:
        c.kill_all()
    text = c.log_text()
    assert code == 0, text[-4000:]
    assert "with 2 processes for 4 ranks" in text, text[-4000:]
    m = c.membership()
    assert m is not None and sorted(m.hosted) == [2, 3]
    got = {r: torch.load(c.out / f"final_rank{r}.pt", weights_only=True) for r in (0, 1)}
    for r in (0, 1):
        assert int(got[r]["recoveries"]) == 1
        assert int(got[r].pop("pid")) == first[r], "a survivor finished in its first process"
        for key in ("rng_torch", "rng_python", "rng_numpy", "data", "lr"):
            assert torch.equal(got[r][key], want[r][key]), (r, key)
    diff_params = _max_diff(got[0]["params"], want[0]["params"])
    diff_opt = _max_diff(got[0]["optimizer"]["state"], want[0]["optimizer"]["state"])
    bitwise = diff_params == 0.0 and diff_opt == 0.0
    print(f"fewer ranks (2 processes for 4 ranks from step 8): max |param diff| = {diff_params:.3g}, "
          f"max |optimizer state diff| = {diff_opt:.3g}, bitwise = {bitwise}")
    assert diff_params < 1e-5 and diff_opt < 1e-5

