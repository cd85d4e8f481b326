"""The user's own epoch loop inside a Trainer class, killed for real: bitwise equal to the fault-free run.

``ckptless-chaos run`` on the two Trainer-class examples (real etcd, real agents,
a real SIGKILL at an exact step, the library's digests as the verdict, which
include the loop's position and every RNG stream):

* examples/ddp_trainer.py (the DDP tutorial's shape): rank 0, which writes the
  script's own ``snapshot.pt``, killed in the middle of epoch 1 and again in
  epoch 2; the replacement reads ``epochs_run`` from that snapshot, so its
  ``range(self.epochs_run, ...)`` starts elsewhere and ``ckptless.epochs``
  matches the resume epoch by value.
* examples/gpt_trainer.py (minGPT's shape): killed inside an eval pass (the
  second ``ckptless.batches`` pass of an epoch counted from 1).
* tests/harness/scripts/augmented_workers.py (a vision pipeline's shape): two
  loader workers drawing a random transform per sample, killed mid-epoch: the
  reopened pass's new workers must draw what the original's drew.

The same logic in one process, under hypothesis-chosen rollbacks and with
loader workers and torchdata's loader: tests/unit/test_loop.py.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from ..harness.chaos_cli import passes
from ..harness.repo import PYTHON, REPO, SCRIPTS, child_env

SMALL = ["--nnodes", "1", "--nproc-per-node", "2"]


def _steps(out: Path, scenario: str) -> int:
    doc = json.loads(sorted((out / scenario / "digest").glob("digest_rank*.json"))[0].read_text())
    assert "_ckptless_loop" in doc["objects"] and "rng" in doc["objects"]
    return int(doc["step"])


@pytest.mark.rotating(3)  # CI budget: tests/harness/rotation.py (job.train's loop is killed daily under the
@pytest.mark.timeout(300)  # HF and Lightning integrations, tests/e2e/test_integrations_e2e.py, and unit-tested)
def test_ddp_trainer_class_killed_twice_mid_epoch_resumes_bitwise(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # 512 samples / 2 ranks / 16 per batch = 16 steps an epoch: steps 21 and 38 are mid-epoch 1 and 2
    line = passes(capsys, "run", "kill-twice", "--script", str(REPO / "examples" / "ddp_trainer.py"), *SMALL,
                  "--rank", "0", "--at", "21,38", "--out", str(tmp_path), "--", "--epochs", "3", "--save-every", "1")
    assert "bitwise equal" in line and "generation 2" in line, line
    assert _steps(tmp_path, "kill-twice") == 48
    snapshot = tmp_path / "kill-twice" / "work" / "snapshot.pt"
    assert snapshot.exists()  # the script's own per-epoch snapshot, which the replacements read at setup


@pytest.mark.rotating(1)  # CI budget: tests/harness/rotation.py
@pytest.mark.timeout(300)
def test_gpt_trainer_killed_in_an_eval_pass_resumes_bitwise(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # 2 epochs of 19 train + 2 eval steps per rank: step 20 is the second batch of epoch 1's eval pass
    line = passes(capsys, "run", "kill-worker", "--script", str(REPO / "examples" / "gpt_trainer.py"), *SMALL,
                  "--at", "20", "--out", str(tmp_path), "--", "--epochs", "2")
    assert "bitwise equal" in line, line
    assert _steps(tmp_path, "kill-worker") == 42


@pytest.mark.rotating(2)  # CI budget: tests/harness/rotation.py (the logic runs daily in tests/unit/test_loop.py)
@pytest.mark.timeout(300)
def test_random_transforms_in_loader_workers_resume_bitwise(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # 256 samples / 2 ranks / 8 per batch = 16 steps an epoch: step 11 is mid-epoch 0, with both workers'
    # streams advanced by the samples they loaded (was: other transforms after the reopening, FAIL)
    line = passes(capsys, "run", "kill-worker", "--script", str(SCRIPTS / "augmented_workers.py"), *SMALL,
                  "--at", "11", "--out", str(tmp_path), "--", "--epochs", "2")
    assert "bitwise equal" in line, line
    assert _steps(tmp_path, "kill-worker") == 32


@pytest.mark.timeout(300)
def test_random_transforms_in_persistent_loader_workers_resume_bitwise(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 35, finding 7: the same with persistent_workers=True, killed mid-epoch 1 (step 20), when the
    # workers were started an epoch earlier (was: FAIL, other transforms after the reopening, nothing said)
    line = passes(capsys, "run", "kill-worker", "--script", str(SCRIPTS / "augmented_workers.py"), *SMALL,
                  "--at", "20", "--out", str(tmp_path), "--", "--epochs", "2", "--persistent")
    assert "bitwise equal" in line, line
    assert _steps(tmp_path, "kill-worker") == 32


@pytest.mark.timeout(300)
def test_persistent_workers_that_cannot_be_seeded_are_refused_at_start() -> None:
    # Issue 35, finding 7: an IterableDataset's persistent workers carry their streams across passes and
    # have no per-sample fetch to seed: one ConfigError at the first pass, a user error, before any step.
    t0 = time.monotonic()
    res = subprocess.run([PYTHON, "-m", "ckptless.launcher.main", "--standalone", "--nproc-per-node", "2",
                          str(SCRIPTS / "augmented_workers.py"), "--persistent", "--iterable"],
                         env=child_env(), capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    assert res.returncode == 1, res.stderr[-3000:]
    reason = [ln for ln in res.stderr.splitlines() if ln.startswith("Reason: ")]
    assert len(reason) == 1 and "invalid persistent_workers=True" in reason[0], res.stderr[-3000:]
    assert "DataLoader over Stream" in reason[0] and "pass persistent_workers=False" in reason[0]
    assert "a user error" in reason[0] and took < 120, (took, reason)
