"""A prefetching while-loop with a best metric, ported with ``job.carry``, killed twice for real (issue 38).

examples/prefetch_train.py has nanoGPT's loop: the first batch fetched before
the loop, the next one fetched inside the step (between the forward and the
backward, as nanoGPT prefetches), gradient accumulation over two micro-batches,
the best validation loss kept across iterations; batches sampled from each
rank's global torch stream. Its port protects ``X``, ``Y`` and
``best_val_loss`` with one ``job.carry(...)`` line.

* ``ckptless-chaos run kill-twice`` (real etcd, agents, workers, rank 0
  SIGKILLed at steps 10 and 26, the second time the replacement): every
  protected object, the carried values included, bitwise equal to the
  fault-free run.
* The same loop with the three values left in plain locals (the example with
  ``c.X`` -> ``X`` ..., its ``job.carry`` line removed): the same kills end with
  the model and the optimizer differing (a survivor resumes with a later
  step's prefetched batch, the replacement with its setup's), and the verdict
  quotes the start-up check naming ``best_val_loss, X, Y``.

The two tests took 32.5 s together here (2-core VM, other jobs queued; each
job run ~7 s fault-free), so both run in CI.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptless.chaos.script import ScriptJob, run_script

from ..harness.repo import REPO

EXAMPLE = REPO / "examples" / "prefetch_train.py"
AT = [10, 26]  # of 40 steps; evaluations at multiples of 8, so each resume crosses one


def _job(script: Path) -> ScriptJob:
    return ScriptJob(script=script, args=("--max-iters", "40"), nnodes=1, nproc_per_node=2)


def unprotected(tmp_path: Path) -> Path:
    """The example with its loop-carried values in plain locals: what a port without ``job.carry`` runs."""
    text = EXAMPLE.read_text()
    carry = re.search(r"^ *c = job\.carry\(.*\n", text, re.M)
    assert carry is not None
    text = text.replace(carry.group(0), "")
    text = re.sub(r"\bc\.(X|Y|best_val_loss)\b", r"\1", text)
    assert "c.X" not in text and "c.best_val_loss" not in text
    out = tmp_path / "prefetch_unprotected.py"
    out.write_text(text)
    return out


@pytest.mark.timeout(400)
def test_prefetching_loop_with_carried_values_killed_twice_is_bitwise(tmp_path: Path) -> None:
    v = run_script("kill-twice", _job(EXAMPLE), tmp_path, rank=0, at=AT, log=lambda line: print(line, flush=True))
    print(v.line, flush=True)
    assert v.passed, v.line + "\n" + "\n".join(v.reasons)
    assert "generation 2" in v.line, v.line
    assert v.faulty is not None and v.faulty.digests[0]["step"] == 40
    assert {"carried", "model", "optimizer", "rng"} <= set(v.faulty.digests[0]["objects"])
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "kill-twice" / "logs").glob("agent*.log"))
    assert "carries unprotected" not in logs, "the start-up check named a value the port protects"


@pytest.mark.rotating(2)  # CI budget: tests/harness/rotation.py (the negative control; the protected loop runs daily)
@pytest.mark.timeout(400)
def test_the_same_loop_with_unprotected_locals_differs_and_is_named(tmp_path: Path) -> None:
    v = run_script("kill-twice", _job(unprotected(tmp_path)), tmp_path, rank=0, at=AT,
                   log=lambda line: print(line, flush=True))
    print(v.line, flush=True)
    assert not v.passed, v.line
    assert any("model" in r and "differ" in r for r in v.reasons), v.reasons
    assert "carried" not in v.faulty.digests[0]["objects"] if v.faulty and v.faulty.digests else True
    hint = re.search(r"carries unprotected from one iteration to the next: (\w+(?:, \w+)*)\]", v.line)
    assert hint is not None and set(hint.group(1).split(", ")) == {"X", "Y", "best_val_loss"}, v.line
