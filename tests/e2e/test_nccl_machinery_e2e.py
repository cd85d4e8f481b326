"""A recovery meets torch's own NCCL machinery (issue 36), on the stand-in that models it (tests/harness/nccl_like.py).

Real jobs, real agents, real etcd, real SIGKILLs; the groups' CPU collectives on the backend with NCCL's
and torch's failure semantics, as measured on one H200 (docs/gpu-runs/2026-11-28-h200/):

* the dump key: a failure the watchdog sees leaves ``exception_dump`` in the job store's root, and the
  heartbeat monitor of any process whose first group sees it ends that process after the heartbeat
  timeout. Without ckptless's settings (ckptless/worker/nccl_env.py) every replacement died that long
  after it joined;
* a formation that a second failure interrupts: the survivors sit in the unique-id ``get`` (holding
  their store client) or behind the init's lock; they must leave at once and the next generation form.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ckptless.coordinator.embedded import EmbeddedEtcd

from ..harness import nccl_like
from ..harness.cluster import (FaultFree, assert_bitwise_equal, assert_recovered, assert_survivors_kept_pids,
                               new_cluster, reformed_after)
from ..harness.waiting import wait_json

HEARTBEAT_S = 2  # torch's heartbeat timeout, shortened (480 s by default): the monitor acts this long after the key


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_replacement_outlives_the_dump_key_a_failure_left(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                             baseline: FaultFree) -> None:
    """Rank 1 dies at step 5; the transport reports it at once (``NCCL_LIKE_REPORT_S=0``: the watchdog
    sees the failure before ckptless aborts), so the survivors' watchdogs write the dump key. The
    replacement forms its first group in generation 1, and must still be alive several heartbeat timeouts
    later, while rank 0 holds at step 9; the job then ends bitwise with no other recovery."""
    env = {**nccl_like.job_env(), "NCCL_LIKE_REPORT_S": "0", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(HEARTBEAT_S),
           "TORCH_NCCL_COORD_CHECK_MILSEC": "200", "REF_PAUSE_RANK": "1", "REF_PAUSE_STEP": "5",
           "REF_PAUSE_RANK2": "0", "REF_PAUSE_STEP2": "9", "REF_PAUSE_RELEASE": "go"}
    c = new_cluster(module_etcd.endpoint, tmp_path, "dumpkey", **env)
    try:
        c.start_agent()
        c.start_agent()
        os.kill(c.paused_pid(1), signal.SIGKILL)
        c.paused_pid(0, "2")  # rank 0 holds at step 9: the replacement has formed and trained steps 5-8
        replacement = int(c.pids(1)[-1]["pid"])  # type: ignore[call-overload]
        window = time.monotonic() + 3 * HEARTBEAT_S + 2  # the monitor's window: a deadline, not a synchronisation
        while time.monotonic() < window:
            assert _alive(replacement), "torch's monitor ended the replacement"
            time.sleep(0.05)
        c.release("go2")  # pause point 2 ends on OUT/<REF_PAUSE_RELEASE>2
        c.wait(180)
    finally:
        c.kill_all()
    text = c.log_text()
    assert "writing exception_dump to the root store" in text, "no watchdog saw the failure: the test shows nothing"
    assert "Terminating the process" not in text
    assert_recovered(c, baseline, {1})
    m = c.membership()
    assert m is not None and m.generation == 1, f"another recovery happened (generation {m and m.generation})"


def test_a_second_failure_inside_the_formation_ends_it_at_once(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                              baseline: FaultFree) -> None:
    """Rank 1 dies at step 5; while generation 1 forms, rank 0 (the root of every group's unique-id
    exchange) is killed after the formation's check-in, so ranks 2, 3 and the replacement sit in the
    unique-id ``get`` on their store client (held up to the client's 30 s timeout) or behind the init's
    lock. They leave, connect a fresh client, form generation 2 and end bitwise, well inside that timeout."""
    chaos = tmp_path / "chaos"
    c = new_cluster(module_etcd.endpoint, tmp_path, "formkill", **nccl_like.job_env(), REF_PAUSE_RANK="1",
                    REF_PAUSE_STEP="5", CKPTLESS_CHAOS_DIR=str(chaos), CKPTLESS_CHAOS_POINTS="form=bind:r0:g1")
    goodput = c.out / "goodput"
    try:
        c.start_agent("--goodput-dir", str(goodput))
        c.start_agent("--goodput-dir", str(goodput))
        os.kill(c.paused_pid(1), signal.SIGKILL)
        paused = wait_json(chaos / "paused_form.json", 120)
        killed_at = time.time()
        os.kill(int(paused["pid"]), signal.SIGKILL)
        c.wait(180)
    finally:
        c.kill_all()
    m = c.membership()
    assert m is not None and m.generation >= 2
    formed = reformed_after(goodput, {2, 3}, 2, killed_at)
    print(f"generation 2 formed {formed} s after the kill inside generation 1's formation")
    assert all(dt < 20 for dt in formed.values()), f"generation 2 formed late after the second kill: {formed}"
    assert_bitwise_equal(c.finals(), baseline.finals)
    assert_survivors_kept_pids(c, {0, 1})
    text = c.log_text()
    assert "tearing the process down" not in text and "Terminating the process" not in text
