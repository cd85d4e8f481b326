"""A kill inside a gradient-accumulation window, at every position of a window of 4 (issue 38).

tests/harness/scripts/accumulate_by_hand.py: a ``job.train`` loop over a DDP model that calls
``backward()`` on every batch (under ``no_sync()`` but the window's last) and steps AdamW every 4
batches, counted on a protected counter; 36 batches per rank over 2 epochs, windows across the
epoch boundary. One faulty run SIGKILLs rank 0 four times, each time held at a batch in another
position of its window (step 9: 1 micro-batch of the window done, 18: 2 and the epoch's first batch,
27: 3, 32: the window's first), against the fault-free run, under the real launcher, etcd and agents.

Before the fix (ckptless/state/window.py) a version taken between a window's micro-batches was the
resume version, and the gradients of the micro-batches before it were lost: ``model, optimizer
differ``. Now every recovery resumes at a window's start (a multiple of 4) and runs the window again;
the verdict is every protected object of every rank bitwise equal to the fault-free run's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptless.chaos.schedule import Fault, FaultKind
from ckptless.chaos.script import ScriptJob, run_script

from ..harness.repo import REPO

JOB = ScriptJob(script=REPO / "tests" / "harness" / "scripts" / "accumulate_by_hand.py", nnodes=1, nproc_per_node=2)
KILLS = (9, 18, 27, 32)  # positions 1, 2, 3, 0 of their windows of 4


@pytest.mark.timeout(400)
def test_kills_at_every_position_of_an_accumulation_window_resume_bitwise(tmp_path: Path) -> None:
    assert sorted(s % 4 for s in KILLS) == [0, 1, 2, 3]
    v = run_script("kill-window", JOB, tmp_path, faults=lambda steps: [Fault(s, FaultKind.KILL_WORKER, (0,))
                                                                       for s in KILLS],
                   log=lambda line: print(line, flush=True))
    assert v.passed, v.line + "\n" + "\n".join(v.reasons)
    assert v.faulty is not None and v.faulty.digests[0]["step"] == 36
    assert {"model", "optimizer", "micro", "_ckptless_loop", "rng"} <= set(v.faulty.digests[0]["objects"])
    assert v.faulty.generation is not None and v.faulty.generation >= len(KILLS), v.line
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "kill-window" / "logs").glob("agent*.log"))
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", logs)]
    assert resumed and all(s % 4 == 0 for s in resumed), f"a recovery resumed inside a window: {resumed}"
