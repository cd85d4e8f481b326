"""Corruption decided by evidence, never looped (issue 35, findings 2 and 9).

The DDP example (2 agents x 2 workers, world 4, real etcd, real processes) with
chaos bit flips in the replicated parameters (``CKPTLESS_CHAOS_POINTS``
``flip:r<R>:<S>``, ckptless/chaos_hooks.py) under ``--on-replica-mismatch replace``:

* the same bit flipped on both ranks of node 1 (ranks 2 and 3: a bad node) is a
  2 vs 2 tie: no copy is proven right, so the job stops at once with one error naming
  both pairs and the tensor; nobody is replaced, nothing waits out a round's deadline
  for a version that can never commit (it waited 90 s, then resumed at the flipped
  version; with the flip repeating it looped without end);
* a rank replaced for corruption that shows corruption again is not replaced again:
  the job stops, naming it.

The verdict itself (every pattern of corrupt copies over any layout) is
``tests/unit/test_replica_verdict.py``'s.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd

from ..harness.cluster import wait_exit
from .test_ddp_fsdp_e2e import DDP_SCRIPT, ExampleCluster, _run

STOP_WITHIN_S = 30.0  # from the flip to every agent's exit: a round's deadline is 60 s, a final commit's 90 s


def _flips(etcd: EmbeddedEtcd, out: Path, points: str) -> ExampleCluster:
    chaos = out / "chaos"
    chaos.mkdir(parents=True, exist_ok=True)
    c = _run(etcd, out, DDP_SCRIPT, (), CKPTLESS_CHAOS_DIR=str(chaos), CKPTLESS_CHAOS_POINTS=points)
    c.start_agent("--on-replica-mismatch", "replace")  # ranks 0, 1
    c.start_agent("--on-replica-mismatch", "replace")  # ranks 2, 3: "node 1"
    return c


def _stopped(c: ExampleCluster, flip: Path) -> float:
    """Every agent ended non-zero; seconds from the (last) flip to the last agent's exit."""
    codes = [wait_exit(a, 150, "an agent of a job stopped by silent data corruption") for a in c.agents]
    end = time.time()
    assert all(code != 0 for code in codes), f"exit codes {codes}\n{c.tail()}"
    return end - float(json.loads(flip.read_text())["t_wall"])


def _job_failed_line(text: str) -> str:
    found = re.search(r"job failed: (.*)", text)
    assert found is not None, text[-4000:]
    return found.group(1)


def test_the_same_flip_on_both_ranks_of_a_node_stops_the_job_naming_both_pairs(module_etcd: EmbeddedEtcd,
                                                                              tmp_path: Path) -> None:
    """2 vs 2 (finding 2): no majority, so no rank is named odd and nobody is replaced; one clear stop in
    seconds naming ranks 2, 3 against 0, 1 and the flipped tensor, labelled corruption (finding 9: not
    a user error, no failed GPU on a CPU job); no final state is written."""
    out = tmp_path / "tie"
    c = _flips(module_etcd, out, "a=flip:r2:5,b=flip:r3:5")
    try:
        took = _stopped(c, out / "chaos" / "flipped_b.json")
    finally:
        c.kill_all()
    text = c.log_text()
    assert took < STOP_WITHIN_S, f"stopped {took:.1f}s after the flip\n{text[-4000:]}"
    assert "was not committed within" not in text, text[-4000:]
    assert "is the odd one" not in text and "leaves to be rebuilt" not in text, text[-4000:]
    assert not re.search(r"rank \d: resumed at step", text), "a rank was replaced on a tie"
    found = re.search(r"silent data corruption at step 5: no majority[^\n]*", text)
    assert found is not None, text[-4000:]
    line = found.group(0)
    assert "ranks 0, 1" in line and "ranks 2, 3" in line and "model.0.weight" in line, line
    failed = _job_failed_line(text)
    assert "user error" not in failed and "SilentDataCorruption" in failed, failed
    assert "GPU" not in failed, failed
    assert not list(out.glob("final_rank*.pt")), "a rank finished the job after the corruption"


@pytest.mark.rotating(2)  # CI budget: tests/harness/rotation.py (a replacement, then the stop: ~35 s)
def test_a_rank_replaced_for_corruption_that_shows_it_again_stops_the_job_naming_it(module_etcd: EmbeddedEtcd,
                                                                                   tmp_path: Path) -> None:
    """Rank 2 is flipped at step 5 (1 vs 3: replaced and rebuilt from its replicas), and its replacement
    again at step 9: replacing it again would loop on a persistently bad rank or node, so the job stops
    with one error naming rank 2 and its earlier replacement."""
    out = tmp_path / "again"
    c = _flips(module_etcd, out, "a=flip:r2:5,b=flip:r2:9")
    try:
        took = _stopped(c, out / "chaos" / "flipped_b.json")
    finally:
        c.kill_all()
    text = c.log_text()
    first = json.loads((out / "chaos" / "flipped_a.json").read_text())
    second = json.loads((out / "chaos" / "flipped_b.json").read_text())
    assert first["pid"] != second["pid"], "the second flip did not hit rank 2's replacement"
    assert re.search(r"rank 2: resumed at step \d+ in generation 1", text), text[-4000:]
    assert took < STOP_WITHIN_S, f"stopped {took:.1f}s after the second flip\n{text[-4000:]}"
    found = re.search(r"silent data corruption at step 9: [^\n]*rank 2[^\n]*already replaced for corruption[^\n]*",
                      text)
    assert found is not None, text[-4000:]
    failed = _job_failed_line(text)
    assert "user error" not in failed and "rank 2" in failed, failed
    assert not list(out.glob("final_rank*.pt")), "a rank finished the job after the corruption"
