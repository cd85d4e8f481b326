"""Going on with fewer ranks (issue 22, ``--lost-node shrink``): a node lost with no spare, real processes.

Real etcd, two agents x two workers of examples/ddp_train.py (DDP, a DistributedSampler behind a
stock DataLoader, dropout, gradient clipping, AdamW, OneCycle), ``--nnodes 1:2``. Rank 2 holds at
the start of step 8; the test SIGKILLs its whole node (the agent; its workers die with it). With
no spare and no node to respawn on, the leader hosts ranks 2 and 3 on the survivors holding their
images: the job goes on with two processes for four ranks, each also running a lost rank's
micro-batch of every step. Then a new agent with the same command joins (a scheduler's
replacement node): it serves as spares, the job grows back to four processes at a step boundary
(the hosted ranks' state handed to the spares as images), and finishes. What must hold:

* the survivors finish in their first processes, with two recoveries (fewer ranks, grown back);
  ranks 2 and 3 on the new agent's node;
* every rank's RNG streams and data position end bitwise equal to the fault-free run's (the
  hosted micro-batches drew from the lost ranks' streams, not the hosts', and the spares took
  those streams over);
* parameters and optimizer state end within floating-point reduction order of the fault-free
  run: the difference is printed (and recorded in docs/failure-model.md, "Fewer ranks").
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.report.status import read_status

from ..harness.cluster import descendants
from ..harness.waiting import wait_json, wait_until
from .test_ddp_fsdp_e2e import DDP_SCRIPT, _baseline, _run

STEPS = ("--steps", "40")  # (the example's own order of 16 batches per epoch: 2.5 epochs)
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


@pytest.mark.rotating(2)  # CI budget (tests/harness/rotation.py); the micro-batches and the planner run daily
def test_node_lost_without_spares_the_survivors_go_on_with_fewer_ranks_then_grow_back(
        module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    want = _baseline(module_etcd, tmp_path, DDP_SCRIPT, STEPS)
    chaos = tmp_path / "chaos"
    # Rank 0 holds at step 10 (with fewer ranks) until the new agent's spares are registered; rank 1
    # waits for it in DDP's all-reduce meanwhile, so the collective timeout must outlast that.
    c = _run(module_etcd, tmp_path / "shrink", DDP_SCRIPT, STEPS, EXAMPLE_PAUSE="2:8", CKPTLESS_CHAOS_DIR=str(chaos),
             CKPTLESS_CHAOS_POINTS="hold=step:r0:10", CKPTLESS_COLLECTIVE_TIMEOUT="150")
    try:
        c.start_agent(*SHRINK)
        c.start_agent(*SHRINK)
        paused = wait_json(c.out / "paused_rank2.json", 120)
        first = c.worker_pids()
        victim = next(a for a in c.agents if int(paused["pid"]) in descendants(a.pid))
        os.kill(victim.pid, signal.SIGKILL)
        wait_json(chaos / "paused_hold.json", 120)  # rank 0 about to run step 10, with fewer ranks
        text = c.log_text()
        assert "with 2 processes for 4 ranks" in text, text[-4000:]
        shrunk = c.membership()
        assert shrunk is not None and sorted(shrunk.hosted) == [2, 3]
        status = read_status(c.endpoint, c.job_id)
        assert "running 4 ranks on 2 processes: ranks [2, 3] hosted" in status.fewer, status
        newcomer = c.start_agent(*SHRINK)  # the scheduler's replacement node, the same command
        with c.client() as client:
            spares = Keyspace(c.job_id).spares_prefix
            wait_until(lambda: len(client.get_prefix(spares)[0]) == 2, 120, "the new agent's two spares")
            wait_until(lambda: client.get(Keyspace(c.job_id).grow(shrunk.generation)) is not None, 60,
                       "the leader asking the generation with fewer ranks to grow back")
        (chaos / "release_hold").write_text("go")  # the processes agree on it at a boundary of the steps left
        c.wait(expect_fail=[victim])
    finally:
        c.kill_all()
    text = c.log_text()
    assert f"leaving generation {shrunk.generation}: growing back to full width at step" in text, text[-4000:]
    grown = c.membership()
    assert grown is not None and not grown.hosted
    new_node = next(a.node_id for a in grown.ranks if a.rank == 2)
    assert f"-{newcomer.pid}-" in new_node and grown.worker_of(3).node_id == new_node
    got, pids = c.finals_with_pids()
    for r in range(4):
        for key in ("rng_torch", "rng_python", "rng_numpy", "data", "lr"):
            assert torch.equal(got[r][key], want[r][key]), (r, key)
    for r in (0, 1):
        assert pids[r] == first[r], "a survivor finished in its first process"
        assert int(got[r]["recoveries"]) == 2  # went on with fewer ranks, then grew back
    diff_params = max(_max_diff(got[r]["params"], want[r]["params"]) for r in range(4))
    diff_opt = max(_max_diff(got[r]["optimizer"]["state"], want[r]["optimizer"]["state"]) for r in range(4))
    for r in (1, 2, 3):  # every rank the same replica again after growing back
        assert _max_diff(got[r]["params"], got[0]["params"]) == 0.0
    bitwise = diff_params == 0.0 and diff_opt == 0.0
    print(f"fewer ranks (2 processes for 4 ranks from step 8, grown back to 4 at step 11): "
          f"max |param diff| = {diff_params:.3g}, max |optimizer state diff| = {diff_opt:.3g}, bitwise = {bitwise}")
    assert diff_params < 1e-5 and diff_opt < 1e-5
