"""torchtitan's own Trainer under ckptless, killed for real: bitwise equal to the fault-free run.

``ckptless-chaos run kill-twice`` (real etcd, an agent, 2 workers, SIGKILLs at exact steps, the library's
digests as the verdict) on examples/torchtitan_train.py, torchtitan 0.3.0's train.py with the 5 lines
docs/porting.md shows, through ``ckptless.integrations.torchtitan.train``. torchtitan's ``Trainer``
is built by its own ``config.build()``: its llama3 model (tiny sizes), FSDP2 over both ranks by its
``parallelize_llama``, its ``OptimizersContainer`` (AdamW) and warm-up/decay ``LRSchedulersContainer``,
gradient accumulation 2 (global batch 8 = 2 ranks x 2 x 2), gradient clipping, its
``ParallelAwareDataloader``, and its ``CheckpointManager`` writing DCP checkpoints every 3 steps (the
disk tier, kept through both recoveries). On CPU: tests/harness/titan_cpu.py says what stands in for
the accelerator (the device module, the inner attention, the data) and why.

Rank 0 is killed at step 4 and its replacement at step 8; what is compared holds the model's shards,
AdamW's state, the schedulers, the loader's position, the train state (step, tokens seen), the loop's
position and every RNG stream.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptless.chaos.script import ScriptJob, run_script

from ..harness.repo import REPO

TITAN = ScriptJob(
    script=REPO / "examples" / "torchtitan_train.py",
    args=("--module", "tests.harness.titan_cpu", "--config", "tiny_cpu", "--dump_folder", "{out}/titan",
          "--training.steps", "12", "--training.global_batch_size", "8",
          "--checkpoint.enable", "--checkpoint.interval", "3"),
    nnodes=1, nproc_per_node=2,
    env={"CKPTLESS_TEST_TITAN_CPU": "1", "PYTHONPATH": str(REPO / "tests" / "harness" / "titan_site")})


@pytest.mark.rotating(2)  # CI budget (tests/harness/rotation.py): ~25 s; tests/unit/test_torchtitan.py runs daily
@pytest.mark.timeout(300)
def test_torchtitan_trainer_killed_twice_resumes_bitwise(tmp_path: Path) -> None:
    v = run_script("kill-twice", TITAN, tmp_path, rank=0, at=[4, 8], log=lambda line: print(line, flush=True))
    assert v.passed, v.line + "\n" + "\n".join(v.reasons)
    assert v.faulty is not None and v.faulty.generation == 2, v.line
    digest = v.faulty.digests[0]
    assert digest["step"] == 12
    assert {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"} <= set(digest["objects"])
    # torchtitan's own checkpointer went on writing through both recoveries (the disk tier is kept)
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "kill-twice" / "titan").rglob("step-*"))
    assert steps == [3, 6, 9, 12], steps
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "kill-twice" / "logs").glob("agent*.log"))
    assert "waits for the capture's copies" not in logs, "the capture no longer overlaps AdamW's step"
