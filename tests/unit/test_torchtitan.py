"""ckptless.integrations.torchtitan's parts, on torchtitan 0.3's own Trainer built in this process on CPU.

One Gloo rank (world 1: FSDP2's ``fully_shard`` over it, as ``parallelize_llama`` builds it), the Trainer
from torchtitan's ``Trainer.Config`` (tests/harness/titan_cpu.py: what stands in for the accelerator).
The kills are in tests/e2e/test_torchtitan_e2e.py; here, what each protected object is and that its
state round-trips exactly: the optimizer that is protected is the one AdamW steps (the container's own
``state_dict`` would step it), the loader's state holds no ``bytes`` and resumes the same batches
without drawing from the restored streams, the refusals name their setting.
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ckptless.errors import ConfigError
from ckptless.state.tree import encode

from ..harness import titan_cpu

titan_cpu.use_cpu()  # before torchtitan's modules are imported (below, and by the integration)

from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from ckptless.integrations import torchtitan as tt  # noqa: E402


def _build(tmp: Path) -> Trainer:
    trainer = Trainer(titan_cpu.tiny_config(steps=6, dump_folder=str(tmp)))
    gc.enable()  # torchtitan's GarbageCollection disables the collector for its own loop
    return trainer


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    streams = torch.get_rng_state(), random.getstate(), np.random.get_state()
    tmp = tmp_path_factory.mktemp("titan")
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # torchtitan's get_local_device() reads it
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)
    try:
        yield tmp
    finally:
        dist.destroy_process_group()
        if local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = local_rank
        torch.set_rng_state(streams[0])
        random.setstate(streams[1])
        np.random.set_state(streams[2])
        gc.enable()


@pytest.fixture(scope="module")
def trainer(world: Path) -> Trainer:
    return _build(world / "a")


def _steps(trainer: Trainer, it: Any, n: int) -> None:
    for _ in range(n):
        trainer.step += 1
        trainer.train_step(it)


def test_the_protected_objects_are_the_trainers_own(trainer: Trainer) -> None:
    objs = tt.stateful_objects(trainer)
    assert list(objs) == ["model", "optimizer", "lr_scheduler", "dataloader", "train_state"]
    assert objs["model"] is trainer.model_parts[0] and isinstance(objs["model"], FSDPModule)
    assert objs["optimizer"] is trainer.optimizers.optimizers[0]
    assert type(objs["optimizer"]) is torch.optim.AdamW  # the one that steps, not the container
    assert objs["lr_scheduler"] is trainer.lr_schedulers
    assert objs["dataloader"].loader is trainer.dataloader
    trainer.ntokens_seen, trainer.step = 96, 3
    assert objs["train_state"].state_dict() == {"step": 3, "ntokens_seen": 96}
    objs["train_state"].load_state_dict({"step": 0, "ntokens_seen": 0})
    assert (trainer.step, trainer.ntokens_seen) == (0, 0)
    tree, _ = encode({name: obj.state_dict() for name, obj in objs.items()})  # the image holds all of it
    assert set(tree["d"][i][0] for i in range(len(tree["d"]))) == set(objs)


def test_a_capture_before_the_first_step_leaves_adamw_as_it_was(world: Path) -> None:
    """Why the container is not protected: its ``state_dict()`` runs a zero-lr step on an optimizer
    with no state (``init_optim_state``), and AdamW's first real step would then be its second."""
    trainer = _build(world / "b")
    inner = tt.stateful_objects(trainer)["optimizer"]
    inner.state_dict()
    assert not inner.state, "protecting the optimizer changed it"
    trainer.optimizers.state_dict()
    steps = {float(s["step"]) for s in inner.state.values()}
    assert steps == {1.0}, f"torchtitan's container no longer steps at its state_dict(): {steps}"


def test_the_loaders_state_resumes_the_same_batches_without_drawing(trainer: Trainer) -> None:
    loader = tt.LoaderState(trainer.dataloader)
    it = iter(trainer.dataloader)
    _steps(trainer, trainer.batch_generator(it), 2)
    saved = loader.state_dict()
    encode(saved)  # no bytes left in it
    want = [next(it)[1] for _ in range(3)]
    loader.load_state_dict(saved)
    rng = torch.get_rng_state()
    loader.state_dict()  # the capture after a restore: torchdata makes the resuming iterator here
    assert torch.equal(torch.get_rng_state(), rng), "the capture after a restore drew from torch's stream"
    resumed = iter(trainer.dataloader)
    got = [next(resumed)[1] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "the loader resumed elsewhere"


def test_what_is_not_covered_is_refused_by_name(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="torchtitan.trainer.Trainer"):
        tt.check_supported(SimpleNamespace())  # type: ignore[arg-type]
    monkeypatch.setattr(trainer, "fwd_bwd_fn", lambda *a: None)
    with pytest.raises(ConfigError, match="disable_cuda_graphs"):
        tt.check_supported(trainer)
    monkeypatch.undo()
    monkeypatch.setattr(trainer, "parallel_dims", SimpleNamespace(pp_enabled=True))
    with pytest.raises(ConfigError, match="pipeline_parallel_degree"):
        tt.check_supported(trainer)
    monkeypatch.undo()
    tt.check_supported(trainer)
