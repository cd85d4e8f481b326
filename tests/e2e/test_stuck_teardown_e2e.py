"""A worker whose program ended but whose teardown never does (issue 35 finding 4's hang): bounded.

Real etcd, 2 agents x 2 workers of tests/harness/scripts/train_ref.py, no fault in training. Rank 3's
process registers, before ``ckptless.init()``, an atexit hook that blocks in native code (libc
``pause()``): the program returns, its final state is written, ckptless's own exit hook declares the
end with its code (0), then the teardown blocks forever -- as the filer saw a worker "stuck in native
code at exit after all final states were written" when the job had lost its leader's node, its agent
waiting on it for good (still running at 195 s and 405 s).

What must hold: the agent ends the stuck process ``--shutdown-timeout`` seconds after its declared end,
says so in one line, records its exit as the code its program ended with, and every agent exits 0;
the final states are bitwise the fault-free run's. Was: both agents waited forever (the store's host
for rank 3's exit record).
"""

from __future__ import annotations

from pathlib import Path

from ckptless.coordinator.embedded import EmbeddedEtcd

from ..harness.cluster import FaultFree, assert_bitwise_equal, new_cluster


def test_a_worker_stuck_in_its_teardown_after_its_program_ended_does_not_hold_the_job(
        module_etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    c = new_cluster(module_etcd.endpoint, tmp_path, "stuckexit", REF_STUCK_AT_EXIT_RANK="3")
    try:
        c.start_agent("--shutdown-timeout", "3")
        c.start_agent("--shutdown-timeout", "3")
        c.wait(timeout=60)
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline.finals)
    text = c.log_text()
    assert "ended its program with code 0" in text and "is still in its teardown" in text, c.tail()
    rec = c.exit_record(3)
    assert rec is not None and rec.exitcode == 0 and rec.signal is None, rec
