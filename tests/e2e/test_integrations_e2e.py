"""Frameworks' own loops under ckptless, killed for real: bitwise equal to the fault-free run.

``ckptless-chaos run kill-twice`` (real etcd, agents, workers, SIGKILLs at exact
steps, the library's digests as the verdict) on the two integration examples:

* examples/hf_trainer.py: a Hugging Face ``Trainer`` (a GPT-2 built from a
  config, gradient accumulation 2, a cosine schedule with warm-up, dropout),
  through ``ckptless.integrations.hf.train``. Rank 0 is killed at the first
  optimizer step of epoch 2 and again mid-epoch; what is compared holds the
  model, AdamW, the scheduler, the ``TrainerState`` (log history included)
  and every RNG stream.
* examples/lightning_train.py: a Lightning ``Trainer`` (DDP strategy, AdamW,
  an epoch-interval StepLR, dropout) through ``ckptless.integrations.lightning.fit``.
  Rank 0 is killed at the first batch of epoch 2 and again mid-epoch; what is
  compared is Lightning's whole checkpoint dictionary (module, optimizer,
  scheduler, loops' progress, the loader's position) and the RNG streams.

Skipped when the framework is not installed (``pip install 'ckptless[hf]'``,
``'ckptless[lightning]'``; ``make test`` installs both).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..harness.chaos_cli import passes
from ..harness.repo import REPO

SMALL = ["--nnodes", "1", "--nproc-per-node", "2"]


def _pass(capsys: pytest.CaptureFixture[str], script: str, at: str, *script_args: str, out: Path) -> str:
    line = passes(capsys, "run", "kill-twice", "--script", str(REPO / "examples" / script), *SMALL, "--rank", "0",
                  "--at", at, "--out", str(out), "--", *script_args)
    assert "generation 2" in line, line
    return line


@pytest.mark.timeout(300)
def test_hf_trainer_killed_twice_resumes_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    # 12 optimizer steps, 6 an epoch: step 6 opens epoch 2, step 9 is in its middle
    _pass(capsys, "hf_trainer.py", "6,9", "--epochs", "2", out=tmp_path)


@pytest.mark.timeout(300)
def test_lightning_fit_killed_twice_resumes_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lightning")
    # 24 batches an epoch per rank: step 24 opens epoch 2 (after the epoch's LR step), step 35 is mid-epoch
    _pass(capsys, "lightning_train.py", "24,35", "--epochs", "2", out=tmp_path)
